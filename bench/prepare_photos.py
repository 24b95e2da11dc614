"""Builds an ImageFolder of real photographs for bench/images.sh.

Source: the photographs that ship inside the scikit-image wheel (astronaut,
chelsea the cat, coffee, rocket, motorcycles, the Hubble deep field, a
retina, ...), fetched from PyPI with `pip download`. Each photo becomes one
class and is re-encoded as JPEG (quality 90) at several sizes and crops, so
the folder has the size mix of real datasets:

  --sizes imagenet  long side 333..500 px (ImageNet-like; the default)
  --sizes mixed     long side 256..3000 px (phone photos included)

Usage: python bench/prepare_photos.py OUT [--sizes imagenet|mixed]
To benchmark your own data instead, pass any ImageFolder to bench/images.sh.
"""

import argparse
import glob
import io
import os
import random
import subprocess
import sys
import tempfile
import zipfile

from PIL import Image

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
          "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "grass.png",
          "gravel.png", "brick.png", "camera.png", "coins.png", "moon.png"]
SIZES = {"imagenet": [333, 375, 400, 450, 500], "mixed": [256, 375, 500, 800, 1200, 2000, 3000]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sizes", choices=SIZES, default="imagenet")
    ap.add_argument("--crops", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "scikit-image==0.26.0", "-d", d], check=True)
        wheel = zipfile.ZipFile(glob.glob(os.path.join(d, "*.whl"))[0])
        rng = random.Random(0)
        n = 0
        for name in PHOTOS:
            img = Image.open(io.BytesIO(wheel.read(f"skimage/data/{name}"))).convert("RGB")
            cls = os.path.join(a.out, os.path.splitext(name)[0])
            os.makedirs(cls, exist_ok=True)
            for size in SIZES[a.sizes]:
                for c in range(a.crops):
                    # A random crop of 60-100% per side, then the target size.
                    w, h = img.size
                    cw, ch = int(w * rng.uniform(0.6, 1)), int(h * rng.uniform(0.6, 1))
                    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
                    part = img.crop((x, y, x + cw, y + ch))
                    k = size / max(part.size)
                    part = part.resize((max(1, round(cw * k)), max(1, round(ch * k))), Image.LANCZOS)
                    part.save(os.path.join(cls, f"{size}_{c}.jpg"), quality=90)
                    n += 1
    print(f"{n} photographs in {a.out}")


if __name__ == "__main__":
    main()
