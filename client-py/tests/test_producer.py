"""The Python producer: an iterable of batches shared through a real
broker with Python and Rust consumers."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import batchcast
from conftest import LIMIT, needs_torch, python_child, report

BATCH = 8
PER_EPOCH = 4


def make_batch(epoch: int, index: int, samples: int = BATCH):
    """Batch `index` of `epoch`: images filled with a value that names the
    sample, labels = epoch·1000 + index·10 + sample."""
    ids = epoch * 1000 + index * 10 + np.arange(samples, dtype=np.int64)
    images = (ids[:, None, None] % 251).astype(np.uint8) * np.ones((samples, 3, 5), np.uint8)
    weights = ids.astype(np.float32)[:, None] * np.array([0.5, 0.25], np.float32)
    return images, ids, weights


def epoch_batches(epoch: int, short_last: bool = True):
    for i in range(PER_EPOCH):
        n = 5 if short_last and i == PER_EPOCH - 1 else BATCH
        yield make_batch(epoch, i, n)


class Loader:
    """A plain Python iterable with len(): each pass is one epoch."""

    def __init__(self, delay: float = 0.0):
        self.epoch = 0
        self.delay = delay

    def __len__(self):
        return PER_EPOCH

    def __iter__(self):
        e = self.epoch
        self.epoch += 1
        for b in epoch_batches(e):
            time.sleep(self.delay)
            yield b


CHECKER = r"""
import json, sys
import numpy as np
import batchcast
c = batchcast.Consumer(stream=sys.argv[2], socket=sys.argv[1], output="numpy", connect_timeout=60)
out = []
while not c.ended:
    for images, labels, weights in c:
        out.append([c.epoch, len(labels), labels.tolist(), int(images[:, 0, 0].sum()), weights.tolist()])
print(json.dumps(out))
"""


def check_python_report(rows, epochs):
    assert len(rows) == epochs * PER_EPOCH
    for k, (epoch, n, labels, image_sum, weights) in enumerate(rows):
        index = k % PER_EPOCH
        assert epoch == k // PER_EPOCH
        images, ids, w = make_batch(epoch, index, n)
        assert labels == ids.tolist()
        assert image_sum == int(images[:, 0, 0].sum())
        assert np.allclose(weights, w)


def check_rust_dump(dump: Path, epochs: int):
    for e in range(epochs):
        for i in range(PER_EPOCH):
            n = 5 if i == PER_EPOCH - 1 else BATCH
            images, ids, w = make_batch(e, i, n)
            assert (dump / f"e{e}-b{i}-0.bin").read_bytes() == images.tobytes()
            assert (dump / f"e{e}-b{i}-1.bin").read_bytes() == ids.tobytes()
            assert (dump / f"e{e}-b{i}-2.bin").read_bytes() == w.tobytes()


def test_a_plain_iterable_is_shared_with_python_and_rust_consumers(start_broker, tmp_path):
    broker = start_broker()  # no config: only producers' streams
    dump = tmp_path / "rust"
    rust = broker.rust_consumer("--stream", "shared", "--dump", str(dump), "--connect-timeout", "60")
    child = python_child(CHECKER, broker.socket, "shared")
    rows_here = []

    def here():
        c = batchcast.Consumer(stream="shared", socket=broker.socket, output="numpy", connect_timeout=60)
        while not c.ended:
            for images, labels, weights in c:
                rows_here.append(
                    [c.epoch, len(labels), labels.tolist(), int(images[:, 0, 0].sum()), weights.tolist()]
                )

    t = threading.Thread(target=here)
    t.start()
    result = batchcast.Producer(
        Loader(), stream="shared", socket=broker.socket, epochs=3, min_consumers=3
    ).run()
    assert result["batches"] == 3 * PER_EPOCH and result["epochs"] == 3
    t.join(60)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    check_python_report(json.loads(out), 3)
    check_python_report(rows_here, 3)
    r = report(rust)
    assert r["ok"] and r["ended"] and r["batches"] == 3 * PER_EPOCH, r
    check_rust_dump(dump, 3)


@needs_torch
def test_a_torch_dataloader_is_shared(start_broker, tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = 3 * BATCH + 5  # drop_last=False: the last batch holds 5
    ids = torch.arange(n, dtype=torch.int64)
    images = (ids % 251).to(torch.uint8)[:, None, None].expand(n, 3, 5).contiguous()
    weights = ids.to(torch.bfloat16)[:, None].expand(n, 2).contiguous()
    loader = DataLoader(TensorDataset(images, ids, weights), batch_size=BATCH, shuffle=False)
    broker = start_broker()
    dump = tmp_path / "rust"
    rust = broker.rust_consumer("--stream", "dl", "--dump", str(dump), "--connect-timeout", "60")
    got = []

    def here():
        c = batchcast.Consumer(stream="dl", socket=broker.socket, connect_timeout=60, as_dict=True)
        while not c.ended:
            for batch in c:
                got.append({k: v.clone() for k, v in batch.items()})

    t = threading.Thread(target=here)
    t.start()
    batchcast.Producer(loader, stream="dl", socket=broker.socket, epochs=2, min_consumers=2).run()
    t.join(60)
    assert len(got) == 2 * len(loader)
    for k, b in enumerate(got):
        i = k % len(loader)
        lo, hi = i * BATCH, min((i + 1) * BATCH, n)
        assert torch.equal(b["0"], images[lo:hi])
        assert torch.equal(b["1"], ids[lo:hi])
        assert b["2"].dtype == torch.bfloat16 and torch.equal(b["2"], weights[lo:hi])
    r = report(rust)
    assert r["ok"] and r["batches"] == 2 * len(loader), r
    assert (dump / "e1-b3-1.bin").read_bytes() == ids[3 * BATCH :].numpy().tobytes()


def test_a_producer_killed_mid_epoch_gives_consumers_a_clear_error(start_broker):
    broker = start_broker()
    producer = python_child(
        r"""
import sys, time
import numpy as np
import batchcast
def loader():
    for i in range(1000):
        print("batch", i, flush=True)
        time.sleep(0.05)
        yield (np.full((4, 2), i, np.int32),)
batchcast.Producer(loader(), stream="dying", socket=sys.argv[1], batches_per_epoch=1000).run()
""",
        broker.socket,
    )
    c = batchcast.Consumer(stream="dying", socket=broker.socket, output="numpy", connect_timeout=60)
    it = iter(c)
    (x,) = next(it)
    assert x.shape == (4, 2)
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    t0 = time.monotonic()
    with pytest.raises(batchcast.StreamError) as e:
        for _ in range(1000):
            next(it)
    assert time.monotonic() - t0 < 5
    assert e.value.code == "SourceFailed"
    msg = str(e.value)
    assert "producer" in msg and "stopped after" in msg and "mid-epoch" in msg, msg


RIDING_PRODUCER = r"""
import sys, time
import numpy as np
import batchcast

class Loader:
    # Batch i of epoch e: 4 samples, each 3 values e * 1000 + i.
    def __init__(self):
        self.epoch = -1
    def __len__(self):
        return 50
    def __iter__(self):
        self.epoch += 1
        for i in range(50):
            time.sleep(0.01)
            yield (np.full((4, 3), self.epoch * 1000 + i, np.int32),)

# Room for a consumer's batches of 5 over the stream's 4.
out = batchcast.Producer(Loader(), stream="fed", socket=sys.argv[1], min_consumers=2, slots=8,
                         reconnect_timeout=30).run(epochs=3)
print(out["batches"])
"""

RIDING_CONSUMER = r"""
import json, sys
import batchcast
c = batchcast.Consumer(stream="fed", socket=sys.argv[1], output="numpy", connect_timeout=60,
                       reconnect_timeout=30, batch_size=int(sys.argv[2]))
epochs = {}
while not c.ended:
    for b in c:
        epochs.setdefault(b.epoch, []).extend(int(v) for v in b[0][:, 0])
print(json.dumps({"epochs": epochs}))
"""


def test_a_producer_and_its_consumers_ride_through_broker_restarts(start_broker):
    # The producer registers its stream again and publishes its last
    # batches again itself; each consumer resumes where it was: every
    # sample once, in order, the producer's values.
    broker = start_broker()
    producer = python_child(RIDING_PRODUCER, broker.socket)
    consumers = [python_child(RIDING_CONSUMER, broker.socket, n) for n in ("4", "5")]

    def reading_on(s: dict) -> bool:
        for p in [producer, *consumers]:
            if p.poll() is not None:
                pytest.fail(f"a child ended early:\n{p.communicate()[1]}")
        return any(
            st["name"] == "fed"
            and len(st["consumers"]) == 2
            and all(c["delivered"] >= 10 for c in st["consumers"])
            for st in s["streams"]
        )

    for _ in range(2):
        broker.wait_for("both consumers to read on", reading_on)
        broker.kill()
        time.sleep(0.2)
        broker = start_broker()
    out, err = producer.communicate(timeout=LIMIT)
    assert producer.returncode == 0, err
    assert out.strip() == "150", out  # the loader's batches, each once
    assert err.count("is back after") == 2 and "publishes its last" in err, err
    want = {str(e): [e * 1000 + i for i in range(50) for _ in range(4)] for e in range(3)}
    for c in consumers:
        out, err = c.communicate(timeout=LIMIT)
        assert c.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        assert err.count("is back after") == 2, err
        assert r["epochs"] == want, err


def consume_until_error(broker, stream: str):
    """A consumer thread that reads until the stream fails; the list gets
    the StreamError it ends with."""
    errors = []

    def here():
        c = batchcast.Consumer(stream=stream, socket=broker.socket, output="numpy", connect_timeout=60)
        try:
            for _ in c:
                pass
        except batchcast.StreamError as e:
            errors.append(e)

    t = threading.Thread(target=here)
    t.start()
    return t, errors


def test_a_batch_that_departs_from_the_schema_stops_the_stream_clearly(start_broker):
    broker = start_broker()

    def loader():
        yield np.zeros((4, 3), np.float32), np.arange(4)
        yield np.zeros((4, 3), np.float32), np.arange(4)
        yield np.zeros((4, 7), np.float32), np.arange(4)  # another per-sample shape

    t, errors = consume_until_error(broker, "s")
    with pytest.raises(batchcast.SchemaError, match=r"'0' is f32 \[7\] per sample.*\[3\]"):
        batchcast.Producer(loader(), stream="s", socket=broker.socket, batches_per_epoch=3).run()
    t.join(30)
    assert errors and errors[0].code == "SourceFailed"
    assert "f32 [7] per sample" in str(errors[0]), str(errors[0])


def test_a_loader_error_reaches_the_consumers(start_broker):
    broker = start_broker()

    def loader():
        yield (np.zeros((2, 2), np.uint8),)
        raise OSError("cannot read /data/shard-7.tar")

    t, errors = consume_until_error(broker, "s")
    with pytest.raises(OSError, match="shard-7"):
        batchcast.Producer(loader(), stream="s", socket=broker.socket, batches_per_epoch=5).run()
    t.join(30)
    assert errors and "shard-7" in str(errors[0])


def test_producer_arguments_are_checked(start_broker):
    broker = start_broker()
    with pytest.raises(ValueError, match="no len"):
        batchcast.Producer(iter([]), socket=broker.socket).run()
    with pytest.raises(ValueError, match="no batch"):
        batchcast.Producer([], socket=broker.socket).run()
    with pytest.raises(batchcast.SchemaError, match="only tensors and numpy arrays"):
        batchcast.Producer([(np.zeros(2), ["a", "b"])], socket=broker.socket).run()
    with pytest.raises(ValueError, match="epochs"):
        batchcast.Producer([(np.zeros(2),)], socket=broker.socket).run(epochs=0)


def test_a_producer_stream_refuses_replay_and_says_why(start_broker):
    broker = start_broker()
    t = threading.Thread(
        target=lambda: batchcast.Producer(
            Loader(), stream="ext", socket=broker.socket, epochs=1, min_consumers=1
        ).run()
    )
    t.start()
    with pytest.raises(batchcast.StreamError, match=r"fed by an external producer.*cannot be recomputed"):
        batchcast.Consumer(stream="ext", socket=broker.socket, output="numpy", join="now", connect_timeout=60)
    c = batchcast.Consumer(stream="ext", socket=broker.socket, output="numpy", join="immediate")
    assert sum(1 for _ in c) == PER_EPOCH
    t.join(60)


class _Loader:
    """A loader whose len() says `says` batches and which yields `yields`."""

    def __init__(self, says: int, yields: int):
        self.says, self.yields = says, yields

    def __len__(self) -> int:
        return self.says

    def __iter__(self):
        for i in range(self.yields):
            yield (np.full((2, 2), i, np.int32),)


@pytest.mark.parametrize("says,yields,why", [(5, 3, "ended after 3 batches"), (3, 5, "more than 3 batches")])
def test_a_loader_whose_length_disagrees_with_len_stops_the_stream(start_broker, says, yields, why):
    # docs/python-client.md: a loader whose length disagrees with len() stops the stream:
    # the producer raises SchemaError and the consumers get SourceFailed.
    broker = start_broker()
    errors = []

    def read_epochs():
        # Across epochs: one too long fails only once its epoch is done.
        c = batchcast.Consumer(stream="s", socket=broker.socket, output="numpy", connect_timeout=60)
        try:
            for _ in range(3):
                for _ in c:
                    pass
        except batchcast.StreamError as e:
            errors.append(e)

    t = threading.Thread(target=read_epochs, daemon=True)
    t.start()
    with pytest.raises(batchcast.SchemaError, match=why):
        batchcast.Producer(_Loader(says, yields), stream="s", socket=broker.socket, epochs=2).run()
    t.join(30)
    assert not t.is_alive()
    assert errors and errors[0].code == "SourceFailed" and why in str(errors[0]), errors


def test_ctrl_c_in_a_producer_stops_its_stream_and_the_consumers_hear_why(start_broker):
    broker = start_broker()
    producer = python_child(
        r"""
import sys, time
import numpy as np
import batchcast
def loader():
    for i in range(1000):
        if i == 2:
            print("producing", flush=True)
        time.sleep(0.02)
        yield (np.full((4, 2), i, np.int32),)
try:
    batchcast.Producer(loader(), stream="s", socket=sys.argv[1], batches_per_epoch=1000).run()
except KeyboardInterrupt:
    print("interrupted", flush=True)
""",
        broker.socket,
    )
    c = batchcast.Consumer(stream="s", socket=broker.socket, output="numpy", connect_timeout=60)
    it = iter(c)
    next(it)
    assert producer.stdout.readline().strip() == "producing"
    producer.send_signal(signal.SIGINT)
    out, err = producer.communicate(timeout=30)
    assert "interrupted" in out, (out, err)
    with pytest.raises(batchcast.StreamError) as e:
        for _ in range(1000):
            next(it)
    assert e.value.code == "SourceFailed"
    assert "KeyboardInterrupt" in str(e.value), str(e.value)
