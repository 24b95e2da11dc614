"""The Python consumer against a real broker."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import batchcast
from conftest import LIMIT, needs_torch, python_child, report, synthetic


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def read_dump(d: Path, epoch: int, index: int, field: str) -> bytes:
    return (d / f"e{epoch}-b{index}-{field}.bin").read_bytes()


def test_content_is_what_the_rust_client_sees_exactly_once_per_epoch(start_broker, tmp_path):
    # 100 samples in batches of 8: 13 batches per epoch, the last one short.
    broker = start_broker(synthetic(min_consumers=2, epochs=3))
    dump = tmp_path / "rust"
    rust = broker.rust_consumer("--verify", "--dump", str(dump))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", name="py")
    assert len(c) == 13 and c.batch_size == 8
    seen = []
    for epoch in range(3):
        assert c.epoch == epoch
        assert not c.ended
        got = []
        for images, labels in c:
            assert images.shape[1:] == (3, 4, 4) and images.dtype == np.uint8
            assert labels.dtype == np.int64 and len(labels) == len(images)
            got.append((c.epoch, len(images), images.tobytes(), labels.tobytes()))
        assert len(got) == 13, f"epoch {epoch}: {len(got)} batches"
        seen.extend((epoch, i, *g[1:]) for i, g in enumerate(got))
    assert c.ended, "ended as soon as the last batch was delivered"
    assert next(iter(c), None) is None and c.ended
    r = report(rust)
    assert r["ok"] and r["verified_samples"] == 300, r
    for epoch, index, samples, image, label in seen:
        assert samples == (4 if index == 12 else 8)
        assert image == read_dump(dump, epoch, index, "image"), (epoch, index)
        assert label == read_dump(dump, epoch, index, "label"), (epoch, index)


def test_batches_are_views_of_the_shared_arena_and_memory_stays_flat(start_broker):
    # 1 MiB per batch, 1000 batches: a copying client would grow by ~1 GiB.
    broker = start_broker(
        synthetic(
            batch=16,
            length=16_000,
            epochs=1,
            fill="stamp",
            fields='{ name = "x", dtype = "u8", shape = [65536] }',
        )
    )
    c = batchcast.Consumer(socket=broker.socket, output="numpy")
    base, length = c.arena
    n = 0
    rss0 = None
    for (x,) in c:
        ptr = x.__array_interface__["data"][0]
        assert base <= ptr and ptr + x.nbytes <= base + length
        assert not x.flags.writeable
        n += 1
        if n == 20:
            rss0 = rss_bytes()  # after the arena's pages are mapped in
    assert n == 1000
    grown = rss_bytes() - rss0
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB over 1000 batches of 1 MiB"


def test_a_write_through_a_numpy_batch_is_refused(start_broker):
    broker = start_broker(synthetic())
    c = batchcast.Consumer(socket=broker.socket, output="numpy")
    images, _ = next(iter(c))
    with pytest.raises(ValueError):
        images[0, 0, 0, 0] = 1


@needs_torch
def test_torch_tensors_are_zero_copy_and_an_in_place_write_cannot_reach_other_consumers(
    start_broker, tmp_path
):
    import torch

    broker = start_broker(synthetic(min_consumers=2, epochs=1))
    dump = tmp_path / "rust"
    rust = broker.rust_consumer("--verify", "--dump", str(dump))
    # A trainer that writes into its batch in place faults in its own process.
    writer = python_child(
        "import batchcast, sys\n"
        "c = batchcast.Consumer(socket=sys.argv[1], connect_timeout=30)\n"
        "images, labels = next(iter(c))\n"
        "print('writing', flush=True)\n"
        "images.add_(1)\n"
        "print('wrote', flush=True)\n",
        broker.socket,
    )
    out, err = writer.communicate(timeout=60)
    assert "writing" in out and "wrote" not in out, (out, err)
    assert writer.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (writer.returncode, err)
    c = batchcast.Consumer(socket=broker.socket, join="immediate")
    base, length = c.arena
    for batch in c:
        images, labels = batch
        assert isinstance(images, torch.Tensor) and images.dtype == torch.uint8
        assert base <= images.data_ptr() < base + length
        assert labels.dtype == torch.int64
    r = report(rust)
    assert r["ok"] and r["batches"] == 13, r


def test_dropping_the_last_reference_frees_the_slot(start_broker):
    broker = start_broker(synthetic(epochs=None, slots=4))
    # Window 1: the program gets the next batch only once this one is
    # released. The broker sends a mailbox consumer batches ahead, as far
    # as the 4 slots go, and reuses none while this consumer holds it.
    c = batchcast.Consumer(socket=broker.socket, output="numpy", window=1, name="holder")

    def delivered() -> int:
        consumers = broker.stream("train")["consumers"]
        return next(x["delivered"] for x in consumers if x["name"] == "holder")

    batch = c.next_batch()
    images = batch["image"]
    copy = images.copy()
    del batch  # the tensor still holds the slot
    gc.collect()
    assert c.held == 1
    broker.wait_for("the broker to send ahead as far as the slots go", lambda s: delivered() == 4)
    time.sleep(0.3)
    assert delivered() == 4, "no slot may be reused while the tensor lives"
    assert np.array_equal(images, copy), "the slot was rewritten under a live tensor"
    del images
    assert c.held == 0
    broker.wait_for("the released slot to be refilled", lambda s: delivered() == 5)
    nxt = c.next_batch()
    assert nxt.index == 1


def test_release_then_use_raises_and_tensors_taken_before_stay_valid(start_broker):
    broker = start_broker(synthetic())
    c = batchcast.Consumer(socket=broker.socket, output="numpy")
    batch = c.next_batch()
    images = batch["image"]
    copy = images.copy()
    batch.release()
    assert batch.released
    with pytest.raises(batchcast.BatchReleased, match="released"):
        batch["label"]
    with pytest.raises(ValueError):  # BatchReleased is a ValueError
        list(batch)
    assert c.held == 1  # `images` keeps the slot
    assert np.array_equal(images, copy)
    del images
    assert c.held == 0
    with c.next_batch() as b:
        assert b["label"].shape == (8,)
    assert b.released and c.held == 0


def test_holding_the_whole_window_blocks_until_another_thread_releases(start_broker):
    broker = start_broker(synthetic(epochs=None, slots=4))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", window=2)
    first, second = c.next_batch(), c.next_batch()
    assert c.held == 2
    # Another thread releases a batch once the program was warned (ordered
    # by the warning itself, not by a sleep a loaded machine can outrun).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        def release_once_warned():
            deadline = time.monotonic() + 60
            while not seen and time.monotonic() < deadline:
                time.sleep(0.05)
            first.release()

        releaser = threading.Thread(target=release_once_warned)
        releaser.start()
        t0 = time.monotonic()
        third = c.next_batch()
        waited = time.monotonic() - t0
        releaser.join()
    full = [w for w in seen if issubclass(w.category, batchcast.WindowFullWarning)]
    assert len(full) == 1 and "holds all 2 batches" in str(full[0].message), [str(w.message) for w in seen]
    assert waited >= 2.0, f"next_batch returned after {waited:.2f} s while the window was full"
    assert third.seq == second.seq + 1


@pytest.mark.parametrize("inherit_ignored_sigint", [False, True])
def test_ctrl_c_interrupts_a_blocking_wait_promptly(start_broker, inherit_ignored_sigint):
    # Two consumers are required before anything is produced: the child waits.
    # With `inherit_ignored_sigint` its parent ignores SIGINT, as a suite
    # started as a background job does: the child must still be interruptible.
    broker = start_broker(synthetic(min_consumers=2))
    child = python_child(
        "import batchcast, sys\n"
        "c = batchcast.Consumer(socket=sys.argv[1], output='numpy')\n"
        "try:\n"
        "    print('waiting', flush=True)\n"
        "    next(iter(c))\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    raise\n",
        broker.socket,
        inherit_ignored_sigint=inherit_ignored_sigint,
    )
    line = child.stdout.readline().strip()
    assert line == "waiting", child.communicate(timeout=10)
    # Signalled once it sleeps in the wait (not while still running Python
    # code before it: that would test nothing).
    wait_until_asleep(child.pid)
    t0 = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=10)
    took = time.monotonic() - t0
    assert "interrupted" in out and "KeyboardInterrupt" in err, (out, err)
    assert took < 2.0, f"Ctrl-C took {took:.2f} s"


def test_ctrl_c_interrupts_the_wait_for_a_broker_that_went_away(start_broker):
    # The default reconnect_timeout (60 s): the child waits for its broker,
    # and Ctrl-C still ends the wait at once.
    broker = start_broker(synthetic(epochs=None))
    child = python_child(
        "import batchcast, sys\n"
        "c = batchcast.Consumer(socket=sys.argv[1], output='numpy')\n"
        "c.next_batch()\n"
        "print('reading', flush=True)\n"
        "try:\n"
        "    while True:\n"
        "        c.next_batch()  # on through the epochs' ends\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    raise\n",
        broker.socket,
    )
    assert child.stdout.readline().strip() == "reading", child.communicate(timeout=10)
    broker.kill()
    # It says once that it waits (and for how long), then sleeps in the wait.
    line = child.stderr.readline()
    if "waits up to 60 s for it to come back" not in line:
        # The rest of what it said (not `communicate`: it would miss what
        # readline buffered).
        child.wait(timeout=10)
        raise AssertionError(f"no wait announced (rc {child.returncode}): {line + child.stderr.read()}")
    wait_until_asleep(child.pid)
    t0 = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=10)
    took = time.monotonic() - t0
    assert "interrupted" in out and "KeyboardInterrupt" in err, (out, err)
    assert took < 2.0, f"Ctrl-C took {took:.2f} s"
    assert "waits up to" not in err, "said once, not again"


def wait_until_asleep(pid: int) -> None:
    """Waits (bounded) until every thread of process `pid` sleeps: it is
    blocked, not running code."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s == "S" for s in states):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never blocked: thread states {states}")


def test_a_killed_broker_surfaces_as_connection_error_promptly(start_broker):
    broker = start_broker(synthetic(epochs=None))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", reconnect_timeout=0)
    it = iter(c)
    next(it)
    broker.kill()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        for _ in range(1000):
            next(it)
    assert isinstance(e.value, batchcast.BrokerUnavailable)
    assert time.monotonic() - t0 < 2.0
    assert "closed the connection" in str(e.value)


def test_errors_say_what_to_do(start_broker, tmp_path):
    broker = start_broker(synthetic())
    with pytest.raises(batchcast.StreamError) as e:
        batchcast.Consumer(stream="nope", socket=broker.socket, output="numpy")
    assert e.value.code == "UnknownStream" and "serves: train" in str(e.value)
    with pytest.raises(ConnectionError, match="is `batchcast serve` running"):
        batchcast.Consumer(socket=tmp_path / "nobody.sock", output="numpy")
    with pytest.raises(ValueError, match="window"):
        batchcast.Consumer(socket=broker.socket, window=0, output="numpy")
    with pytest.raises(ValueError, match="join"):
        batchcast.Consumer(socket=broker.socket, join="sometime", output="numpy")
    with pytest.raises(ValueError, match="output"):
        batchcast.Consumer(socket=broker.socket, output="jax")
    with pytest.raises(ValueError, match="not in stream"):
        batchcast.Consumer(socket=broker.socket, fields=["pixels"], output="numpy")
    with pytest.raises(batchcast.StreamError, match="window 9 .*slots|more than"):
        batchcast.Consumer(socket=broker.socket, window=9, output="numpy")


def test_a_full_or_silent_broker_raises_at_once_never_hangs(start_broker, tmp_path):
    import socket as sk

    broker = start_broker("[broker]\nmax_connections = 16\n" + synthetic())
    # Sixteen connections that never say hello fill the broker.
    idle = [sk.socket(sk.AF_UNIX) for _ in range(16)]
    for s in idle:
        s.connect(str(broker.socket))
    time.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(batchcast.BrokerUnavailable) as e:
        batchcast.Consumer(socket=broker.socket, output="numpy", connect_timeout=30)
    assert time.monotonic() - t0 < 10, "refused at once, not after connect_timeout"
    assert e.value.code == "Busy" and "max_connections" in str(e.value)
    for s in idle:
        s.close()
    # A listener that accepts and never answers: bounded by connect_timeout.
    silent = sk.socket(sk.AF_UNIX)
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(4)
    t0 = time.monotonic()
    with pytest.raises(batchcast.BrokerUnavailable, match="did not answer within"):
        batchcast.Consumer(socket=tmp_path / "silent.sock", output="numpy", connect_timeout=2)
    assert time.monotonic() - t0 < 20
    silent.close()
    # Told to expect another user than the broker's, the client refuses it
    # before sending anything.
    import os

    with pytest.raises(batchcast.BrokerUnavailable, match="may be an impostor"):
        batchcast.Consumer(socket=broker.socket, output="numpy", broker_uid=os.getuid() + 1)
    with pytest.raises(batchcast.BrokerUnavailable, match="may be an impostor"):
        batchcast.Producer([np.zeros((2, 3))], broker_uid=os.getuid() + 1, socket=broker.socket).run(epochs=1)


def test_dict_batches_and_metadata(start_broker):
    broker = start_broker(synthetic(epochs=1))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", as_dict=True)
    batch = c.next_batch()
    assert list(batch) == ["image", "label"] and batch.keys() == ["image", "label"]
    d = batch.to_dict()
    assert d["image"].shape == (8, 3, 4, 4)
    assert (batch.epoch, batch.index, batch.samples) == (0, 0, 8)
    assert c.classes == [] and c.schema["source"]["kind"] == "synthetic"
    stats = c.stats()
    assert stats["batches"] == 1 and 0.0 <= stats["stall_fraction"] <= 1.0


def test_the_broker_sees_the_trainers_wait_and_step_time(start_broker):
    """Data-stall metrics: the time a training step takes (between getting
    a batch and asking for the next) reaches the broker as busy time, and
    the time blocked in next() as wait time; both agree with the client's
    own Consumer.stats()."""
    broker = start_broker(synthetic(epochs=1, length=80, batch=8))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", name="stepper")
    steps = 0
    for batch in c:
        time.sleep(0.02)  # the training step
        steps += 1
        batch.release()
    assert steps == 10
    local = c.stats()
    s = broker.wait_for(
        "every release to arrive",
        lambda s: any(x["name"] == "stepper" and x["delivered"] == 10 and x["held"] == 0
                      for x in s["streams"][0]["consumers"] + s["streams"][0]["past_consumers"]),
    )
    st = s["streams"][0]
    me = next(x for x in st["consumers"] + st["past_consumers"] if x["name"] == "stepper")
    # Nine steps of at least 20 ms each came before a request for a batch.
    assert me["busy_s"] >= 9 * 0.02, me
    assert me["samples"] == 80
    assert local["busy_s"] >= 9 * 0.02
    # The broker's wait is what the client measured in native code; the
    # Python side's includes its own overhead, never less.
    assert me["wait_s"] <= local["wait_s"] + 1e-3, (me, local)
    del c


def test_each_trainer_takes_its_own_batch_size_over_the_same_samples_without_a_copy(
    start_broker, tmp_path
):
    # 100 samples made in batches of 8; trainers take 5 (20 batches) and 12
    # with drop_last (8 batches, the last 4 samples dropped), as views of
    # the shared rings, with the bytes a trainer of the stream's size sees.
    broker = start_broker(synthetic(min_consumers=3, epochs=2, slots=16))
    dump = tmp_path / "rust"
    rust = broker.rust_consumer("--verify", "--dump", str(dump))
    c5 = batchcast.Consumer(socket=broker.socket, output="numpy", name="b5", batch_size=5)
    c12 = batchcast.Consumer(
        socket=broker.socket, output="numpy", name="b12", batch_size=12, drop_last=True
    )
    assert (c5.batch_size, len(c5)) == (5, 20)
    assert (c12.batch_size, len(c12)) == (12, 8)
    got = {5: [], 12: []}
    for epoch in range(2):
        for size, c in ((5, c5), (12, c12)):
            assert c.epoch == epoch
            images, labels = [], []
            base, length = c.arena
            for image, label in c:
                assert len(image) == len(label) <= size
                ptr = image.__array_interface__["data"][0]
                assert base <= ptr and ptr + image.nbytes <= base + length, "a view, not a copy"
                images.append(image.tobytes())
                labels.append(label.tobytes())
            got[size].append((images, labels))
    assert c5.ended and c12.ended
    r = report(rust)
    assert r["ok"] and r["verified_samples"] == 200, r
    sample = 3 * 4 * 4
    for epoch in range(2):
        want_images = b"".join(read_dump(dump, epoch, i, "image") for i in range(13))
        want_labels = b"".join(read_dump(dump, epoch, i, "label") for i in range(13))
        images, labels = got[5][epoch]
        assert [len(b) // sample for b in images] == [5] * 20
        assert b"".join(images) == want_images and b"".join(labels) == want_labels
        images, labels = got[12][epoch]
        assert [len(b) // sample for b in images] == [12] * 8, "the short last batch dropped"
        assert b"".join(images) == want_images[: 96 * sample]
        assert b"".join(labels) == want_labels[: 96 * 8]


def test_a_batch_size_the_stream_cannot_serve_says_what_it_can(start_broker):
    broker = start_broker(synthetic(slots=4))
    for bad in (0, -3):
        with pytest.raises(batchcast.InvalidArgument, match="batch_size must be at least 1"):
            batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=bad)
    with pytest.raises(batchcast.InvalidArgument, match="window must be at least 1"):
        batchcast.Consumer(socket=broker.socket, output="numpy", window=0)
    with pytest.raises(batchcast.InvalidArgument, match=r"window=True must be an integer"):
        batchcast.Consumer(socket=broker.socket, output="numpy", window=True)
    with pytest.raises(
        batchcast.StreamError, match=r"batch_size 100 with window 2.*batch_size ≤ 1 or the stream's 8"
    ):
        batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=100)


def test_keeping_an_old_batch_while_taking_new_ones_raises_ring_pinned(start_broker):
    # 8 slots of 8 samples: a trainer that keeps its first batch (of 5)
    # while it takes and drops the next ones stops the ring when it comes
    # round; it is told so, promptly, instead of waiting forever.
    broker = start_broker(synthetic(slots=8, epochs=None, length=1000))
    c = batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=5)
    it = iter(c)
    kept = next(it)
    t0 = time.monotonic()
    with pytest.raises(batchcast.RingPinned, match="slots are a ring") as e:
        for _ in range(10_000):
            next(it)
    assert isinstance(e.value, batchcast.WindowFull)
    assert time.monotonic() - t0 < 10
    del kept


def test_join_now_mid_epoch_replays_its_start_then_shares_the_same_bytes(start_broker, tmp_path):
    # A paced trainer reads two epochs of 13 batches of 8 (dumping them);
    # a second joins with join="now" in the middle of epoch 1 and gets all
    # of epoch 1 in batches of 5: its start recomputed for it alone, then
    # the shared stream, the same bytes as the first trainer's.
    broker = start_broker(synthetic(epochs=None, slots=6))
    dump = tmp_path / "rust"
    pacer = broker.rust_consumer("--dump", str(dump), "--max-epochs", "2", "--sleep-ms", "30", "--name", "pacer")
    # Reading epoch 1: it gave back 16 units (13 to an epoch). A late
    # trainer joins where the trainers read (the oldest unit the ring
    # holds), not where the pipeline is.
    broker.wait_for(
        "the pacer to be reading epoch 1",
        lambda s: any(
            c["name"] == "pacer" and c["delivered"] - c["held"] >= 16 for c in s["streams"][0]["consumers"]
        ),
    )
    c = batchcast.Consumer(socket=broker.socket, output="numpy", join="now", batch_size=5, name="late")
    images, firsts, replayed = [], [], []
    epoch = None
    for batch in c:
        epoch = batch.epoch
        firsts.append(batch.first_sample)
        replayed.append(batch.replayed)
        images.append(batch[0].tobytes())
    assert epoch is not None and epoch >= 1
    assert firsts == list(range(0, 100, 5)), "a complete epoch, from its start"
    assert replayed[0] and not replayed[-1], replayed
    assert replayed == sorted(replayed, reverse=True), "replayed first, then shared"
    r = report(pacer)
    assert r["ok"], r
    want = b"".join(read_dump(dump, epoch, i, "image") for i in range(13))
    assert b"".join(images) == want
    st = broker.stream("train")
    me = next(x for x in st["consumers"] + st["past_consumers"] if x["name"] == "late")
    assert me["replayed"] == 5 * sum(replayed) and me["replay_cpu_s"] > 0, me
    del c


def test_a_slow_trainer_of_a_decoupled_stream_is_replayed_to_and_gets_the_same_bytes(start_broker, tmp_path):
    # A fast trainer (dumping its batches) and a slow one in Python (20 ms a
    # batch of 5) on a decoupled stream with a ring of 8 units: the slow one
    # falls behind, is cut from the shared stream and replayed to, and
    # still reads every sample of every epoch once, in order, the same
    # bytes as the fast one, which is never replayed to.
    broker = start_broker(
        synthetic(epochs=3, slots=8, min_consumers=2, extra='pace = "decoupled"\nrotate_epochs = false')
    )
    dump = tmp_path / "rust"
    fast = broker.rust_consumer("--dump", str(dump), "--name", "fast")
    c = batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=5, name="slow")
    images, firsts, replayed = [], [], []
    for _ in range(3):  # one epoch per iteration, as a DataLoader
        for batch in c:
            firsts.append((batch.epoch, batch.first_sample))
            replayed.append(batch.replayed)
            images.append(batch[0].tobytes())
            time.sleep(0.02)
    assert firsts == [(e, s) for e in range(3) for s in range(0, 100, 5)], firsts
    assert any(replayed), "it fell behind and was replayed to"
    r = report(fast)
    assert r["ok"] and r["ended"] and r["replayed_batches"] == 0, r
    want = b"".join(read_dump(dump, e, i, "image") for e in range(3) for i in range(13))
    assert b"".join(images) == want
    st = broker.stream("train")
    me = next(x for x in st["consumers"] + st["past_consumers"] if x["name"] == "slow")
    assert me["cuts"] >= 1 and me["replayed"] == 5 * sum(replayed), me


def test_a_late_joiner_of_a_decoupled_stream_reads_rotated_epochs_and_its_state_resumes_them(start_broker):
    # Epochs of 400 samples in units of 8 (50 units), a ring of 8: a trainer
    # joining now 10 batches after a steady one, as fast, reads its first
    # epoch from where the shared stream is and its start after its end
    # (replayed), every sample once. Its state_dict() says so; a resume from
    # it reads the rest of that epoch in the same order, then whole epochs.
    broker = start_broker(synthetic(batch=8, length=400, epochs=2, slots=8, extra='pace = "decoupled"'))
    steady = broker.rust_consumer("--verify", "--sleep-ms", "5", "--name", "steady")
    broker.wait_for(
        "the steady reader to take 10 batches",
        lambda s: any(c["taken"]["batches"] >= 10 for st in s["streams"] for c in st["consumers"]),
    )
    seen = {0: [], 1: []}
    c = batchcast.Consumer(socket=broker.socket, output="numpy", join="now", name="late")
    it = iter(c)
    for _ in range(12):
        batch = next(it)
        seen[batch.epoch].append((batch.first_sample, batch.samples, batch.replayed))
        time.sleep(0.005)
    state = c.state_dict()
    assert state.get("rotated_at", 0) > 0, state
    # It began at the rotation point, from the shared stream.
    assert seen[0][0][0] == state["rotated_at"] and not seen[0][0][2], seen[0][:2]
    del batch, it, c
    c = batchcast.Consumer(socket=broker.socket, output="numpy", state=state, name="late-resumed")
    for _ in range(2):  # the rest of epoch 0, then epoch 1
        for batch in c:
            seen[batch.epoch].append((batch.first_sample, batch.samples, batch.replayed))
            time.sleep(0.005)
    assert report(steady)["ok"]
    for epoch, batches in seen.items():
        samples = [s for first, n, _ in batches for s in range(first, first + n)]
        assert sorted(samples) == list(range(400)), (epoch, batches)
    # Epoch 0 was read from the point to its end, then its start.
    firsts = [first for first, _, _ in seen[0]]
    at = state["rotated_at"]
    assert firsts == list(range(at, 400, 8)) + list(range(0, at, 8)), firsts
    assert all(r for first, _, r in seen[0] if first < at), "its start was replayed"


def test_resume_starts_at_the_checkpoint_position(start_broker, tmp_path):
    broker = start_broker(synthetic(epochs=3, slots=6))
    dump = tmp_path / "rust"
    r = report(broker.rust_consumer("--dump", str(dump)))
    assert r["ok"] and r["ended"], r
    # A trainer saved its checkpoint after the batch ending at sample 37 of
    # epoch 1; it resumes there, in batches of 5.
    c = batchcast.Consumer(socket=broker.socket, output="numpy", resume=(1, 37), batch_size=5)
    got, positions = [], []
    for batch in c:
        got.append(batch[0].tobytes())
        positions.append((batch.epoch, batch.first_sample, batch.next_position))
    assert positions[0] == (1, 37, (1, 42)), positions
    assert positions[-1][2] == (2, 0), "the epoch's last batch: next is epoch 2's start"
    want = b"".join(read_dump(dump, 1, i, "image") for i in range(13))
    sample = 3 * 4 * 4
    assert b"".join(got) == want[37 * sample :]
    del c
    with pytest.raises(batchcast.InvalidArgument, match=r"resume=\(1,\) must be \(epoch, sample\)"):
        batchcast.Consumer(socket=broker.socket, output="numpy", resume=(1,))
    with pytest.raises(batchcast.StreamError, match="stream `train` has 3 epochs"):
        batchcast.Consumer(socket=broker.socket, output="numpy", resume=(3, 0))


def whole_run(start_broker, cfg: str, tmp_path: Path):
    """A broker of `cfg` (3 epochs of 13 batches) and the image bytes of
    its whole run, as a Rust consumer dumped them."""
    broker = start_broker(cfg)
    dump = tmp_path / "rust"
    r = report(broker.rust_consumer("--dump", str(dump)))
    assert r["ok"] and r["ended"], r
    return broker, b"".join(read_dump(dump, e, i, "image") for e in range(3) for i in range(13))


def test_a_state_dict_resumes_exactly_after_a_broker_restart_and_a_changed_stream_is_refused(
    start_broker, tmp_path
):
    cfg = synthetic(epochs=3, slots=6, extra="seed = 4")
    broker, want = whole_run(start_broker, cfg, tmp_path)
    sample = 3 * 4 * 4
    # A trainer of batches of 6 saves its state after 20 batches (17 make
    # epoch 0, the last one short; 3 more: epoch 1, sample 18): a small
    # dict of plain values, through JSON.
    c = batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=6, resume=(0, 0))
    got = []
    for _ in range(20):
        batch = c.next_batch() or c.next_batch()  # past an epoch's end
        got.append(batch[0].tobytes())
        last = batch.next_position
    saved = json.loads(json.dumps(c.state_dict()))
    assert (saved["epoch"], saved["sample"]) == last == (1, 18), saved
    assert saved["stream"] == "train" and saved["batch_size"] == 6 and len(json.dumps(saved)) < 1024
    del c, batch
    # The broker restarts; the trainer comes back from its state, in
    # batches of 4, and reads the rest: every sample once, the same bytes.
    broker.stop()
    broker = start_broker(cfg)
    c = batchcast.Consumer(socket=broker.socket, output="numpy", state=saved, batch_size=4)
    assert c.batch_size == 4
    while not c.ended:
        for batch in c:
            got.append(batch[0].tobytes())
    assert b"".join(got) == want, "every sample once, in order, the same bytes"
    # load_state_dict on a consumer: goes back to the saved place.
    c = batchcast.Consumer(socket=broker.socket, output="numpy", resume=(2, 0))
    c.load_state_dict(saved)
    batch = c.next_batch()
    assert (batch.epoch, batch.first_sample, batch.samples) == (1, 18, 6)
    assert batch[0].tobytes() == want[118 * sample : 124 * sample]
    del c, batch
    # A broker whose stream changed (another seed: another order) refuses.
    broker.stop()
    broker = start_broker(synthetic(epochs=3, slots=6, extra="seed = 5"))
    with pytest.raises(batchcast.StreamError, match="the order or split") as e:
        batchcast.Consumer(socket=broker.socket, output="numpy", state=saved)
    assert e.value.code == "StreamChanged"
    for bad, match in [
        ({**saved, "digest": "x"}, "is not a stream digest"),
        ({k: v for k, v in saved.items() if k != "epoch"}, "`epoch` must be an integer"),
        ({**saved, "version": 2}, "version 2"),
        ([1, 2], "must be the dict"),
    ]:
        with pytest.raises(batchcast.InvalidArgument, match=match):
            batchcast.Consumer(socket=broker.socket, output="numpy", state=bad)
    with pytest.raises(batchcast.InvalidArgument, match="not both"):
        batchcast.Consumer(socket=broker.socket, output="numpy", state=saved, resume=(0, 0))


def test_a_consumer_rides_through_a_broker_restart_holding_a_batch(start_broker, tmp_path):
    cfg = synthetic(epochs=3, slots=6, extra="seed = 6")
    broker, want = whole_run(start_broker, cfg, tmp_path)
    broker.stop()
    broker = start_broker(cfg)
    c = batchcast.Consumer(socket=broker.socket, output="numpy", batch_size=6, reconnect_timeout=30)
    got = []
    for i in range(25):
        batch = c.next_batch() or c.next_batch()  # past an epoch's end
        got.append(batch[0].tobytes())
        if i == 10:
            held = batch
            broker.kill()  # SIGKILL, a batch held
            broker = start_broker(cfg)
    while not c.ended:
        for batch in c:
            got.append(batch[0].tobytes())
    assert held[0].tobytes() == got[10], "a batch held across the restart stays readable"
    assert b"".join(got) == want, "every sample once, in order, the same bytes"
    assert c.reconnects == 1
    del held, batch
    with pytest.raises(batchcast.InvalidArgument, match="reconnect_timeout"):
        batchcast.Consumer(socket=broker.socket, output="numpy", reconnect_timeout=-1)


GROUP_MEMBER = r"""
import json, os, sys
import batchcast
socket, rank = sys.argv[1], sys.argv[2]
# As torchrun sets them: the seat comes from the environment.
os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = rank, "3"
c = batchcast.Consumer(socket=socket, output="numpy", group="trial", batch_size=6)
runs = []
while not c.ended:
    for b in c:
        epoch, end = b.next_position
        end = end or 103  # the epoch's end is the next epoch's start
        runs.append([b.epoch, end - b.samples, b.samples])
print(json.dumps({"runs": runs, "per_epoch": len(c)}))
"""


def test_a_groups_ranks_split_each_epoch_from_torchruns_environment(start_broker):
    # 103 samples an epoch, batches of 6, 3 ranks: 5 full rounds (90
    # samples), the tail of 13 split 5 + 4 + 4; a plain consumer reads all.
    broker = start_broker(synthetic(length=103, min_consumers=4, slots=8, extra="max_batch_size = 8"))
    kids = [python_child(GROUP_MEMBER, broker.socket, str(r)) for r in range(3)]
    plain = batchcast.Consumer(socket=broker.socket, output="numpy", connect_timeout=30)
    plain_samples = 0
    while not plain.ended:
        plain_samples += sum(b.samples for b in plain)
    seen = {0: [0] * 103, 1: [0] * 103}
    counts = set()
    for kid in kids:
        out, err = kid.communicate(timeout=LIMIT)
        assert kid.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        assert r["per_epoch"] == 6
        for epoch in (0, 1):
            mine = [(f, n) for e, f, n in r["runs"] if e == epoch]
            counts.add(len(mine))
            for f, n in mine:
                for s in range(f, f + n):
                    seen[epoch][s] += 1
    assert counts == {6}, "every rank as many batches each epoch"
    assert all(c == 1 for e in seen.values() for c in e), seen
    assert plain_samples == 2 * 103


def test_a_group_from_the_environment_without_a_rank_is_refused(start_broker, monkeypatch):
    broker = start_broker(synthetic(slots=8))
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("BATCHCAST_GROUP", "trial")
    # Not silently a plain consumer reading the whole stream: refused, saying why.
    with pytest.raises(batchcast.InvalidArgument, match=r'BATCHCAST_GROUP="trial": group `trial` without a rank'):
        batchcast.Consumer(socket=broker.socket, output="numpy")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = batchcast.Consumer(socket=broker.socket, output="numpy")
    assert len(c) == 7  # 100 samples in batches of 8: 13 batches, 7 for rank 1 of 2 (the tail split)
    del c


def test_a_group_is_reformed_with_another_world_from_one_members_state(start_broker):
    # 100 samples an epoch; a group of 2 ranks of 4 (8 a step) reads 3
    # rounds; rank 1's state says the group stands at round 3 (sample 24).
    broker = start_broker(synthetic(length=100, slots=8, min_consumers=2, extra="max_batch_size = 8"))
    old = [
        batchcast.Consumer(socket=broker.socket, output="numpy", group="t", rank=r, world=2, batch_size=4)
        for r in range(2)
    ]
    for _ in range(3):
        for c in old:
            c.next_batch()
    state = old[1].state_dict()
    assert (state["group"], state["world"], state["replicate"]) == ("t", 2, 1)
    assert (state["epoch"], state["sample"], state["round_epoch"], state["round_sample"]) == (0, 24, 0, 24)
    del old, c  # the old group is gone (its connections close)
    # Re-formed as one rank: batches of 8 (the same global batch), from the
    # round on: the rest of the epoch once.
    new = batchcast.Consumer(socket=broker.socket, output="numpy", group="t1", rank=0, world=1, state=state)
    assert new.batch_size == 8
    got = []
    while True:
        b = new.next_batch()
        if b is None:
            break
        got.append((b.first_sample, b.samples))
    assert got == [(f, 8) for f in range(24, 96, 8)] + [(96, 4)]
    with pytest.raises(batchcast.InvalidArgument, match="ask for batch_size=8"):
        batchcast.Consumer(socket=broker.socket, output="numpy", group="t2", rank=0, world=1, state=state, batch_size=4)


def test_group_arguments_are_checked(start_broker):
    broker = start_broker(synthetic())
    with pytest.raises(batchcast.InvalidArgument, match="rank=-1"):
        batchcast.Consumer(socket=broker.socket, output="numpy", group="g", rank=-1, world=2)
    with pytest.raises(batchcast.InvalidArgument, match="together"):
        batchcast.Consumer(socket=broker.socket, output="numpy", group="g", rank=1)
    with pytest.raises(batchcast.InvalidArgument, match="outside its world"):
        batchcast.Consumer(socket=broker.socket, output="numpy", group="g", rank=2, world=2)
