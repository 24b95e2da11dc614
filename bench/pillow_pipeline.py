"""The Pillow + numpy pipeline a torchvision user runs per sample:
RandomResizedCrop(224) (torchvision's get_params), RandomHorizontalFlip,
ToTensor + Normalize, float32 CHW. Prints JSON: images, wall and CPU seconds.

Run by bench/images (the `images` harness); `--procs N` uses N worker
processes, as a DataLoader with num_workers=N would.
"""

import argparse
import json
import math
import os
import random
import time
from multiprocessing import Pool

import numpy as np
from PIL import Image

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def rrc_params(width, height, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def sample(path, rng):
    img = Image.open(path).convert("RGB")
    i, j, h, w = rrc_params(img.width, img.height, rng)
    img = img.resize((224, 224), Image.BILINEAR, box=(j, i, j + w, i + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return (x - MEAN) / STD


def work(args):
    paths, seed = args
    rng = random.Random(seed)
    t = time.process_time()
    for p in paths:
        sample(p, rng)
    return time.process_time() - t


def listing(root):
    out = []
    for cls in sorted(e.name for e in os.scandir(root) if e.is_dir()):
        for r, _, fs in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            out += [os.path.join(r, f) for f in sorted(fs) if f.lower().endswith(IMG_EXTENSIONS)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--procs", type=int, default=1)
    a = ap.parse_args()
    paths = listing(a.root) * a.passes
    chunks = [(paths[k :: a.procs], k) for k in range(a.procs)]
    t0 = time.perf_counter()
    if a.procs == 1:
        cpu = work(chunks[0])
    else:
        with Pool(a.procs) as pool:
            cpu = sum(pool.map(work, chunks))
    wall = time.perf_counter() - t0
    print(json.dumps({"images": len(paths), "wall_s": wall, "cpu_s": cpu}))


if __name__ == "__main__":
    main()
