"""Times torchvision's augmentation ops on PIL images (Pillow underneath,
as torchvision runs them on PIL input) for bench/shared_sources.sh.

Usage: python bench/augment_ops.py DATASET OUT N OPS_JSON
Takes the first N photographs of the ImageFolder DATASET, centre-crops
each to 224×224 (Resize 256 + CenterCrop 224), writes the crops as raw RGB
to OUT/<i>.rgb (the Rust side times its ops on the same pixels), then
prints a JSON object: op label -> median seconds per image of five passes.
OPS_JSON: [[label, torchvision name, magnitude, {"interpolation": ...}], ...].
"""

import json
import os
import sys
import time

from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "images"))
from imgtool import image_folder, reference_eval, tv_op  # noqa: E402


def main():
    root, out, n, ops = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    _, samples = image_folder(root)
    crops = []
    for i, (path, _) in enumerate(samples[:n]):
        arr = reference_eval(path, 256, 224)
        with open(os.path.join(out, f"{i}.rgb"), "wb") as f:
            f.write(arr.tobytes())
        crops.append(Image.fromarray(arr))
    if len(crops) < n:
        raise SystemExit(f"{root} has {len(crops)} images, fewer than {n}")
    times = {}
    for label, name, m, opts in ops:
        passes = []
        for _ in range(5):
            t0 = time.perf_counter()
            for c in crops:
                tv_op(c, name, m, **opts)
            passes.append((time.perf_counter() - t0) / len(crops))
        times[label] = sorted(passes)[len(passes) // 2]
    print(json.dumps(times))


if __name__ == "__main__":
    main()
