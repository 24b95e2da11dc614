"""Train a small CNN on an ImageFolder, fed either by batchcast or by a
PyTorch DataLoader, and print throughput and the data-stall fraction.

    python examples/train_torch.py --loader shared       # batchcast.Consumer
    python examples/train_torch.py --loader dataloader   # torch DataLoader

The switch is one line in `make_loader`: that is the whole change a training
script makes to adopt batchcast. `--data` defaults to the demo images that
`batchcast demo` generates. With `--loader shared`, a broker already serving
`--stream` on the socket is used; if none answers, this script starts one
(`batchcast serve`) for `--data` and stops it at the end. Runs on the CPU,
or on CUDA when present.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
REPO = Path(__file__).resolve().parents[1]


def write_report(total, samples, batches, wait, busy):
    """Writes the trainer's numbers so far to $BATCHCAST_REPORT (the run's
    totals plus the epoch in progress), replacing the file whole:
    `batchcast launch` reads it while the trainer runs when the broker
    cannot see its data (its own DataLoader in a --baseline run)."""
    path = os.environ.get("BATCHCAST_REPORT")
    if not path:
        return
    now = {
        "samples": total["samples"] + samples,
        "batches": total["batches"] + batches,
        "wait_s": total["wait_s"] + wait,
        "busy_s": total["busy_s"] + busy,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(now, f)
    os.replace(tmp, path)

def demo_images() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "batchcast" / "demo-images-v1"


def find_batchcast() -> str:
    for candidate in (
        shutil.which("batchcast"),
        REPO / "target" / "release" / "batchcast",
        REPO / "target" / "debug" / "batchcast",
    ):
        if candidate and Path(candidate).exists():
            return str(candidate)
    sys.exit("no `batchcast` binary: run `cargo build --release -p batchcast-cli` or pass --batchcast")


class SmallCNN(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# -- the DataLoader baseline ------------------------------------------------
class FolderDataset(torch.utils.data.Dataset):
    """ImageFolder + RandomResizedCrop + flip + ToTensor + Normalize: with
    torchvision when it is installed, with Pillow otherwise."""

    def __init__(self, root: Path, size: int) -> None:
        self.size = size
        try:
            from torchvision import datasets, transforms

            self.tv = datasets.ImageFolder(
                str(root),
                transforms.Compose(
                    [
                        transforms.RandomResizedCrop(size),
                        transforms.RandomHorizontalFlip(),
                        transforms.ToTensor(),
                        transforms.Normalize(MEAN, STD),
                    ]
                ),
            )
            self.classes = self.tv.classes
        except ImportError:
            self.tv = None
            self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
            exts = {".jpg", ".jpeg", ".png"}
            self.items = [
                (str(f), label)
                for label, c in enumerate(self.classes)
                for f in sorted((root / c).rglob("*"))
                if f.suffix.lower() in exts
            ]

    def __len__(self) -> int:
        return len(self.tv) if self.tv is not None else len(self.items)

    def __getitem__(self, i: int):
        if self.tv is not None:
            return self.tv[i]
        import numpy as np
        from PIL import Image

        path, label = self.items[i]
        img = Image.open(path).convert("RGB")
        w, h = img.size
        for _ in range(10):  # RandomResizedCrop's sampling
            area = w * h * random.uniform(0.08, 1.0)
            ratio = random.uniform(3 / 4, 4 / 3)
            cw, ch = int(round((area * ratio) ** 0.5)), int(round((area / ratio) ** 0.5))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:
            cw, ch, x, y = w, h, 0, 0
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(img, dtype=np.float32) / 255.0
        a = (a - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
        return torch.from_numpy(a.transpose(2, 0, 1).copy()), label


# -- the batchcast side -----------------------------------------------------
def broker_config(root: Path, size: int, batch: int, epochs: int, seed: int) -> str:
    return f"""
[[stream]]
name = "train"
batch_size = {batch}
epochs = {epochs}
seed = {seed}
slots = 6

[stream.image_folder]
root = "{root}"

[stream.transform]
random_resized_crop = {{ size = {size} }}
horizontal_flip = 0.5
normalize = {{ mean = {list(MEAN)}, std = {list(STD)} }}
dtype = "f32"
"""


def start_broker(args, socket: str, tmp: Path) -> subprocess.Popen:
    cfg = tmp / "broker.toml"
    cfg.write_text(broker_config(args.data, args.size, args.batch_size, args.epochs, args.seed))
    proc = subprocess.Popen(
        [args.batchcast, "serve", "--config", str(cfg), "--socket", socket],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "broker.log", "w"),
    )
    print(f"started a broker for {args.data} on {socket} (log: {tmp / 'broker.log'})")
    return proc


def broker_answers(path: str) -> bool:
    """Whether something listens on the socket (without subscribing, which
    would start an epoch nobody reads)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def make_loader(args, data_state=None):
    """The one place the two variants differ. `data_state`: where a shared
    loader goes on from (a checkpoint's `loader.state_dict()`)."""
    if args.loader == "shared":
        import batchcast

        # Its own batch size, whatever the stream's (a running broker's may
        # differ); a state's own batch size is kept when resuming.
        batch_size = None if data_state else args.batch_size
        return batchcast.Consumer(
            stream=args.stream, socket=args.socket, connect_timeout=30, state=data_state, batch_size=batch_size
        )
    dataset = FolderDataset(args.data, args.size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        # As the shared loader: every sample of every epoch, the last batch
        # short, so both count the same samples.
        drop_last=False,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", choices=["shared", "dataloader"], default="shared")
    p.add_argument("--data", type=Path, default=demo_images(), help="an ImageFolder root")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=128, help="crop size")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--stream", default="train")
    p.add_argument("--socket", default=None)
    p.add_argument("--batchcast", default=None, help="the batchcast binary (shared mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--checkpoint", type=Path, help="save model, optimizer and data state here (each epoch's end, and every --checkpoint-every batches)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=0.0, help="add this much time to each training step (a bigger model's; the data stall falls)")
    p.add_argument("--resume", type=Path, help="go on from a checkpoint written by --checkpoint")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = torch.load(args.resume, map_location=device) if args.resume else None
    if ckpt is not None and ckpt["epoch"] >= args.epochs:
        # Saved at the end of the run: there is nothing left to train on.
        print(f"{args.resume} was saved after epoch {ckpt['epoch'] - 1}, the last of {args.epochs}: nothing left to do")
        return

    broker = None
    broker_dir = None
    if args.loader == "shared":
        import batchcast

        if args.socket is None:
            args.socket = str(batchcast.default_socket_path())
        if not broker_answers(args.socket):
            if not args.data.is_dir():
                sys.exit(f"{args.data} is not an image folder: run `batchcast demo` once, or pass --data")
            args.batchcast = args.batchcast or find_batchcast()
            Path(args.socket).parent.mkdir(parents=True, exist_ok=True)
            broker_dir = Path(tempfile.mkdtemp(prefix="batchcast-example-"))
            broker = start_broker(args, args.socket, broker_dir)
    elif not args.data.is_dir():
        sys.exit(f"{args.data} is not an image folder: run `batchcast demo` once, or pass --data")

    failed = True
    try:
        # The shared loader goes on exactly where the checkpoint was, mid-epoch
        # included; a DataLoader starts the epoch it was in again.
        loader = make_loader(args, ckpt and ckpt["data"])
        classes = len(loader.classes if args.loader == "shared" else loader.dataset.classes)
        model = SmallCNN(classes).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        first_epoch = 0
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            first_epoch = ckpt["epoch"]
            print(f"resumed from {args.resume} in epoch {first_epoch}")

        def save(epoch: int) -> None:
            # The loader's state is right after the last batch it handed out:
            # the one just trained on. Written whole or not at all.
            data = loader.state_dict() if args.loader == "shared" else None
            tmp = args.checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "data": data}, tmp)
            os.replace(tmp, args.checkpoint)

        loss_fn = nn.CrossEntropyLoss()
        print(f"{args.loader}: {classes} classes, {len(loader)} batches/epoch, device {device}, lr {args.lr}")
        total = {"samples": 0, "batches": 0, "wait_s": 0.0, "busy_s": 0.0}
        reported = time.perf_counter()
        for epoch in range(first_epoch, args.epochs):
            wait = busy = 0.0
            images_seen = batches = 0
            t_epoch = time.perf_counter()
            t = t_epoch
            for images, labels in loader:
                t_data = time.perf_counter()
                wait += t_data - t
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                loss = loss_fn(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if args.step_ms > 0:
                    time.sleep(args.step_ms / 1000)
                images_seen += len(labels)
                batches += 1
                if args.checkpoint and batches % args.checkpoint_every == 0:
                    save(epoch)
                t = time.perf_counter()
                busy += t - t_data
                if t - reported >= 2.0:
                    reported = t
                    write_report(total, images_seen, batches, wait, busy)
            if args.checkpoint:
                save(epoch + 1)
            seconds = time.perf_counter() - t_epoch
            total["samples"] += images_seen
            total["batches"] += batches
            total["wait_s"] += wait
            total["busy_s"] += busy
            stall = wait / (wait + busy) if wait + busy > 0 else 0.0
            print(
                f"epoch {epoch}: {images_seen} images in {seconds:.2f} s = {images_seen / seconds:.0f} img/s, "
                f"data stall {100 * stall:.0f}%, loss {loss.item():.3f}"
            )
        # `batchcast launch` reads this when the broker cannot see the
        # trainer's data (its own DataLoader in a --baseline run).
        write_report(total, 0, 0, 0.0, 0.0)
        if args.loader == "shared":
            s = loader.stats()
            print(f"batchcast consumer: waited {s['wait_s']:.2f} s, stall fraction {100 * s['stall_fraction']:.0f}%")
        failed = False
    except KeyboardInterrupt:
        failed = False
        raise
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(10)
            # The broker's log is kept where something went wrong, and said.
            if failed:
                print(f"the broker's log: {broker_dir / 'broker.log'}", file=sys.stderr)
            else:
                shutil.rmtree(broker_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
