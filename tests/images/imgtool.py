"""Test-image generation and Pillow + numpy reference checks for the image
pipeline's end-to-end tests (tests/images.rs) and its benchmark.

Subcommands:
  make-folder ROOT [--bad] [--large] [--count N]
      An ImageFolder of generated images in every mode the pipeline must
      read (baseline/progressive/grayscale/CMYK JPEG; 8/16-bit, palette,
      alpha PNG; BMP, PPM/PGM, TIFF, WebP, GIF; odd, tiny and large sizes). --bad adds corrupt, truncated,
      empty, non-image and unsupported files.
  make-asymmetric ROOT N
      N images dark on the left, bright on the right (for flip statistics).
  make-photos ROOT N
      N photo-like JPEGs of several sizes in two classes; prints N.
  ops-reference OUT W H SEED OPS_JSON
      A W×H photo-like image (OUT/src.rgb) and, for each [name, magnitude]
      of OPS_JSON, what torchvision's op on a PIL image makes of it
      (OUT/<i>.rgb): the reference for tests/augment.rs.
  make-shards ROOT OUT PER_SHARD
      WebDataset tar shards (key.jpg/png + key.cls) of an ImageFolder.
  check-eval DUMP ROOT --resize R --crop C [--mean ... --std ...] --dtype D [--ops JSON]
      Compares dumped batches of a Resize + CenterCrop stream (then the
      torchvision ops of --ops, in order) with Pillow + numpy
      (torchvision's procedure); prints a JSON report.
  check-labels DUMP ROOT
      Checks every dumped (index, label) pair against ImageFolder's listing.
  decode-all ROOT OUT
      Pillow's convert("RGB") of every image of an ImageFolder, as raw
      bytes OUT/<n>.rgb, with OUT/index.json listing (path, width, height).
"""

import argparse
import io
import json
import math
import os
import sys
import tarfile

import numpy as np
from PIL import Image

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def photo(w, h, seed):
    """Smooth shapes, gradients and mild noise: photo-like enough that
    resampling differences show up, cheap to make."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy = rng.uniform(0.5, 6, 2) / max(w, h)
        ph = rng.uniform(0, 6.28)
        img[..., c] = 128 + 80 * np.sin(2 * np.pi * (fx * x + fy * y) + ph)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.05, 0.3) * max(w, h)
        col = rng.uniform(0, 255, 3)
        mask = ((x - cx) ** 2 + (y - cy) ** 2) < r * r
        img[mask] = 0.5 * img[mask] + 0.5 * col
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def save(img, path, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, **kw)


def make_folder(root, bad=False, large=False, count=3):
    """Three classes, each with every mode; returns nothing, prints the count."""
    n = 0
    for ci, cls in enumerate(["cat", "dog", "zebra"]):
        d = os.path.join(root, cls)
        for k in range(count):
            s = ci * 1000 + k * 10
            w, h = [(320, 240), (241, 379), (500, 333)][k % 3]
            rgb = Image.fromarray(photo(w, h, s))
            save(rgb, f"{d}/base_{k}.jpg", quality=90)
            save(rgb, f"{d}/prog_{k}.JPEG", quality=85, progressive=True)
            save(rgb.convert("L"), f"{d}/gray_{k}.jpg", quality=90)
            save(rgb.convert("CMYK"), f"{d}/cmyk_{k}.jpg", quality=92)
            save(rgb, f"{d}/rgb8_{k}.png")
            a16 = (photo(w, h, s + 1).astype(np.uint16) * 257)
            write_png16_rgb(a16, f"{d}/rgb16_{k}.png")
            g16 = (photo(w, h, s + 2)[..., 0].astype(np.uint16) * 2)  # small values: PIL clamps
            save(Image.fromarray(g16), f"{d}/gray16_{k}.png")
            save(rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64), f"{d}/pal_{k}.png")
            pt = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
            save(pt, f"{d}/paltrns_{k}.png", transparency=3)
            rgba = rgb.copy()
            rgba.putalpha(Image.fromarray(photo(w, h, s + 3)[..., 1]))
            save(rgba, f"{d}/rgba_{k}.png")
            save(rgb.convert("LA"), f"{d}/la_{k}.png")
            n += 11
            if k == 0:
                n += other_formats(d, k, rgb, rgba, g16, pt)
        # odd and tiny sizes
        save(Image.fromarray(photo(3, 5, ci + 7)), f"{d}/sub/tiny.jpg", quality=95)
        save(Image.fromarray(photo(1, 1, ci + 8)), f"{d}/sub/one.png")
        save(Image.fromarray(photo(223, 17, ci + 9)), f"{d}/sub/thin.png")
        n += 3
        if large:
            save(Image.fromarray(photo(2400, 1800, ci + 11)), f"{d}/large.jpg", quality=90)
            n += 1
    if bad:
        d = os.path.join(root, "dog")
        good = open(os.path.join(root, "cat", "base_0.jpg"), "rb").read()
        open(f"{d}/zz_corrupt.jpg", "wb").write(good[:200] + bytes(range(256)) * 20 + good[-100:])
        open(f"{d}/zz_truncated.jpg", "wb").write(good[: len(good) // 2])
        open(f"{d}/zz_empty.png", "wb").write(b"")
        open(f"{d}/zz_text.png", "wb").write(b"this is not an image\n" * 10)
        # An icon under an image name: a format neither decodes here.
        save(Image.fromarray(photo(20, 20, 5)), f"{d}/zz_unsupported.bmp", format="ICO")
        n += 5
    print(n)


def other_formats(d, k, rgb, rgba, g16, pt):
    """Every other format torchvision's ImageFolder lists, in the modes
    Pillow writes; and GIF bytes under a listed name (ImageFolder lists by
    extension; PIL and batchcast read by content). Returns the count."""
    save(rgb, f"{d}/rgb_{k}.bmp")
    save(rgba, f"{d}/rgba_{k}.bmp")
    save(rgb.convert("L"), f"{d}/gray_{k}.bmp")
    save(rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64), f"{d}/pal_{k}.bmp")
    save(rgb, f"{d}/rgb_{k}.ppm")
    save(rgb.convert("L"), f"{d}/gray_{k}.pgm")
    save(rgb, f"{d}/rgb_{k}.tif")
    save(rgb, f"{d}/lzw_{k}.tiff", compression="tiff_lzw")
    save(rgb.convert("L"), f"{d}/gray_{k}.tif", compression="tiff_deflate")
    save(rgba, f"{d}/rgba_{k}.tif")
    save(Image.fromarray(g16), f"{d}/gray16_{k}.tif")
    save(rgb, f"{d}/lossless_{k}.webp", lossless=True)
    save(rgb, f"{d}/lossy_{k}.webp", quality=90)
    save(rgba, f"{d}/lossy_rgba_{k}.webp", quality=90)
    buf = io.BytesIO()
    pt.save(buf, format="GIF", transparency=3)
    open(f"{d}/gif_{k}.png", "wb").write(buf.getvalue())
    return 15


def write_png16_rgb(a16, path):
    """A true 16-bit RGB PNG (Pillow cannot write one), via zlib."""
    import struct
    import zlib

    h, w, _ = a16.shape
    raw = b"".join(b"\x00" + a16[y].astype(">u2").tobytes() for y in range(h))

    def chunk(t, data):
        c = struct.pack(">I", len(data)) + t + data
        return c + struct.pack(">I", zlib.crc32(t + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").write(png)


def make_asymmetric(root, n):
    for i in range(n):
        a = np.zeros((40, 60, 3), np.uint8)
        a[:, 30:] = 250
        a[:, :30] = 10
        save(Image.fromarray(a), os.path.join(root, "only", f"{i:05d}.png"))


def make_photos(root, n):
    sizes = [(320, 240), (241, 379), (500, 333), (640, 480), (400, 400)]
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        img = Image.fromarray(photo(w, h, 500 + i))
        save(img, os.path.join(root, ["a", "b"][i % 2], f"{i:05d}.jpg"), quality=90)
    print(n)


def tv_inverse_affine(center, angle, translate, scale, shear):
    """torchvision.transforms.functional._get_inverse_affine_matrix."""
    rot = math.radians(angle)
    sx, sy = math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d, -b, 0.0, -c, a, 0.0]
    m = [x / scale for x in m]
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty)
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty)
    m[2] += cx
    m[5] += cy
    return m


def tv_op(img, name, m, interpolation="nearest", fill=None):
    """torchvision.transforms.autoaugment._apply_op (and the other
    transforms' functional calls) on a PIL image, as torchvision does it,
    with the augmentation's interpolation and fill."""
    from PIL import ImageEnhance, ImageOps

    w, h = img.size
    resample = FILTERS[interpolation]
    # torchvision's _parse_fill: None is 0; a number or a list, as ints.
    fill = 0 if fill is None else tuple(int(v) for v in fill) if isinstance(fill, list) else int(fill)

    def affine(center, translate, shear):
        if center is None:
            center = [w * 0.5, h * 0.5]
        mat = tv_inverse_affine(center, 0.0, translate, 1.0, shear)
        return img.transform((w, h), Image.AFFINE, mat, resample, fillcolor=fill)

    if name == "ShearX":
        return affine([0, 0], [0, 0], [math.degrees(math.atan(m)), 0.0])
    if name == "ShearY":
        return affine([0, 0], [0, 0], [0.0, math.degrees(math.atan(m))])
    if name == "TranslateX":
        return affine(None, [int(m), 0], [0.0, 0.0])
    if name == "TranslateY":
        return affine(None, [0, int(m)], [0.0, 0.0])
    if name == "Rotate":
        return img.rotate(m, resample, expand=False, center=None, fillcolor=fill)
    if name == "Brightness":
        return ImageEnhance.Brightness(img).enhance(m)
    if name == "Color":
        return ImageEnhance.Color(img).enhance(m)
    if name == "Contrast":
        return ImageEnhance.Contrast(img).enhance(m)
    if name == "Sharpness":
        return ImageEnhance.Sharpness(img).enhance(m)
    if name == "Hue":
        # torchvision.transforms.functional_pil.adjust_hue
        h, s, v = img.convert("HSV").split()
        np_h = np.array(h, dtype=np.uint8)
        with np.errstate(over="ignore"):
            np_h += np.array(m * 255).astype(np.uint8)
        return Image.merge("HSV", (Image.fromarray(np_h, "L"), s, v)).convert("RGB")
    if name == "Blur":
        # torchvision.transforms.functional_tensor.gaussian_blur on the
        # PIL image's uint8 tensor: float32 kernel, reflect padding, a 2-D
        # correlation (here in float64), rounded half to even.
        kx, ky, sigma = m

        def kernel1d(k):
            x = np.linspace(-(k - 1) * 0.5, (k - 1) * 0.5, k).astype(np.float32)
            pdf = np.exp(-0.5 * (x / np.float32(sigma)) ** 2).astype(np.float32)
            return (pdf / pdf.sum()).astype(np.float32)

        k2 = np.outer(kernel1d(ky), kernel1d(kx)).astype(np.float64)
        a = np.asarray(img).astype(np.float64)
        pad = np.pad(a, ((ky // 2, ky // 2), (kx // 2, kx // 2), (0, 0)), mode="reflect")
        out = np.zeros_like(a)
        for dy in range(ky):
            for dx in range(kx):
                out += k2[dy, dx] * pad[dy : dy + a.shape[0], dx : dx + a.shape[1]]
        return Image.fromarray(np.clip(np.round(out), 0, 255).astype(np.uint8))
    if name == "Posterize":
        return ImageOps.posterize(img, int(m))
    if name == "Solarize":
        return ImageOps.solarize(img, m)
    if name == "AutoContrast":
        return ImageOps.autocontrast(img)
    if name == "Equalize":
        return ImageOps.equalize(img)
    if name == "Invert":
        return ImageOps.invert(img)
    if name == "Grayscale":
        return img.convert("L").convert("RGB")
    if name == "VerticalFlip":
        return img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
    if name == "HorizontalFlip":
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if name == "Identity":
        return img
    raise SystemExit(f"unknown op {name}")


def ops_reference(out, w, h, seed, ops):
    os.makedirs(out, exist_ok=True)
    src = Image.fromarray(photo(w, h, seed))
    with open(os.path.join(out, "src.rgb"), "wb") as f:
        f.write(src.tobytes())
    for i, (name, m, *opts) in enumerate(json.loads(ops)):
        with open(os.path.join(out, f"{i}.rgb"), "wb") as f:
            f.write(tv_op(src, name, m, **(opts[0] if opts else {})).convert("RGB").tobytes())


def image_folder(root):
    """torchvision.datasets.ImageFolder's (path, label) list."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for r, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for f in sorted(fnames):
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(r, f), label))
    return classes, samples


def make_shards(root, out, per_shard):
    _, samples = image_folder(root)
    os.makedirs(out, exist_ok=True)
    for s in range(0, len(samples), per_shard):
        with tarfile.open(os.path.join(out, f"shard-{s // per_shard:06d}.tar"), "w") as tar:
            for i, (path, label) in enumerate(samples[s : s + per_shard]):
                key = f"s{s + i:07d}"
                ext = os.path.splitext(path)[1].lower().lstrip(".")
                tar.add(path, arcname=f"{key}.{ext}")
                data = str(label).encode()
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    print(len(samples))


def decode_all(root, out):
    _, samples = image_folder(root)
    os.makedirs(out, exist_ok=True)
    index = []
    for n, (path, _) in enumerate(samples):
        img = Image.open(path).convert("RGB")
        open(os.path.join(out, f"{n}.rgb"), "wb").write(img.tobytes())
        index.append([path, img.width, img.height])
    json.dump(index, open(os.path.join(out, "index.json"), "w"))
    print(len(index))


def load_dump(dump):
    """{(epoch, batch): {field: bytes}}"""
    out = {}
    for f in os.listdir(dump):
        stem = f[:-4]
        e, b, field = stem.split("-", 2)
        out.setdefault((int(e[1:]), int(b[1:])), {})[field] = open(os.path.join(dump, f), "rb").read()
    return out


def reference_eval(path, resize, crop, whole=None):
    """torchvision Resize(resize) + CenterCrop(crop) on a PIL image, HWC u8;
    with `whole` = (w, h), the whole image resized to w × h instead."""
    img = Image.open(path).convert("RGB")
    if whole:
        return np.asarray(img.resize(whole, Image.BILINEAR))
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(resize * long / short)
    nw, nh = (resize, new_long) if w <= h else (new_long, resize)
    img = img.resize((nw, nh), Image.BILINEAR)
    top = int(round((nh - crop) / 2.0))
    left = int(round((nw - crop) / 2.0))
    return np.asarray(img.crop((left, top, left + crop, top + crop)))


FILTERS = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC,
           "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


def tv_pad(img, ltrb, fill=0, mode="constant"):
    """torchvision's F.pad on a PIL image: ImageOps.expand for constant,
    np.pad for the other modes."""
    from PIL import ImageOps

    if mode == "constant":
        fill = tuple(fill) if isinstance(fill, list) else (fill,) * 3
        return ImageOps.expand(img, border=tuple(ltrb), fill=fill)
    l, t, r, b = ltrb
    return Image.fromarray(np.pad(np.asarray(img), ((t, b), (l, r), (0, 0)), mode))


def tv_geometry(path, steps):
    """torchvision's Resize / CenterCrop / Pad on a PIL image, in order;
    HWC u8. Steps: ["resize", n | [h, w], interpolation?],
    ["center_crop", [h, w]], ["pad", [l, t, r, b], fill?, padding_mode?]."""
    img = Image.open(path).convert("RGB")
    for name, arg, *more in steps:
        w, h = img.size
        filt = FILTERS[more[0]] if more and name == "resize" else Image.BILINEAR
        if name == "resize" and isinstance(arg, int):
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(arg * long / short)
            img = img.resize((arg, new_long) if w <= h else (new_long, arg), filt)
        elif name == "resize":
            img = img.resize((arg[1], arg[0]), filt)
        elif name == "center_crop":
            ch, cw = arg
            if cw > w or ch > h:
                # F.center_crop pads first.
                ltrb = [(cw - w) // 2 if cw > w else 0, (ch - h) // 2 if ch > h else 0,
                        (cw - w + 1) // 2 if cw > w else 0, (ch - h + 1) // 2 if ch > h else 0]
                img = tv_pad(img, ltrb)
                w, h = img.size
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
            img = img.crop((left, top, left + cw, top + ch))
        elif name == "pad":
            img = tv_pad(img, arg, *more)
        else:
            raise SystemExit(f"unknown step {name}")
    return np.asarray(img)


def check_random_crop(a):
    """Each dumped u8 sample against every window torchvision's RandomCrop
    could take (its padding, then pad_if_needed's, with fill and
    padding_mode): the best window's MAE per sample, and how many distinct
    windows were best."""
    _, samples = image_folder(a.root)
    dump = load_dump(a.dump)
    h, w = a.size
    worst, checked, offsets = 0.0, 0, set()
    for (_, _), fields in sorted(dump.items()):
        idx = np.frombuffer(fields["index"], np.int64)
        got = np.frombuffer(fields["image"], np.uint8).reshape(len(idx), 3, h, w).astype(np.float64)
        for j, i in enumerate(idx):
            steps = [["resize", a.resize]] if a.resize else []
            img = Image.fromarray(tv_geometry(samples[i][0], steps))
            img = tv_pad(img, a.padding, a.fill, a.mode)
            if a.pad_if_needed and img.size[0] < w:
                img = tv_pad(img, [w - img.size[0], 0, w - img.size[0], 0], a.fill, a.mode)
            if a.pad_if_needed and img.size[1] < h:
                img = tv_pad(img, [0, h - img.size[1], 0, h - img.size[1]], a.fill, a.mode)
            ref = np.asarray(img).astype(np.float64).transpose(2, 0, 1)
            best = None
            for top in range(ref.shape[1] - h + 1):
                for left in range(ref.shape[2] - w + 1):
                    mae = np.abs(ref[:, top:top + h, left:left + w] - got[j]).mean()
                    if best is None or mae < best[0]:
                        best = (mae, top, left)
            worst = max(worst, best[0])
            offsets.add(best[1:])
            checked += 1
    print(json.dumps({"checked": checked, "mae_worst_image": worst, "offsets": len(offsets)}))


def check_eval(a):
    _, samples = image_folder(a.root)
    dump = load_dump(a.dump)
    dt = {"u8": np.uint8, "f32": np.float32, "f16": np.float16}[a.dtype]
    mean = np.array(a.mean, np.float64) if a.mean else None
    std = np.array(a.std, np.float64) if a.std else None
    per_channel = []
    worst = (0.0, None)
    checked = 0
    for (_, _), fields in sorted(dump.items()):
        idx = np.frombuffer(fields["index"], np.int64)
        h, w = (a.whole[1], a.whole[0]) if a.whole else (a.crop, a.crop)
        if a.size:
            h, w = a.size
        img = np.frombuffer(fields["image"], dt).reshape(len(idx), 3, h, w)
        for j, i in enumerate(idx):
            if a.geometry:
                ref = tv_geometry(samples[i][0], json.loads(a.geometry))
            else:
                ref = reference_eval(samples[i][0], a.resize, a.crop, a.whole)
            for name, m in json.loads(a.ops or "[]"):
                ref = np.asarray(tv_op(Image.fromarray(ref), name, m).convert("RGB"))
            ref = ref.astype(np.float64)
            ref = ref.transpose(2, 0, 1)
            got = img[j].astype(np.float64)
            if a.dtype != "u8":
                # Undo ToTensor + Normalize to compare in 0..255 levels.
                if mean is not None:
                    got = got * std[:, None, None] + mean[:, None, None]
                got = got * 255.0
            err = np.abs(got - ref)
            mae = err.reshape(3, -1).mean(axis=1)
            per_channel.append(mae)
            if mae.max() > worst[0]:
                worst = (float(mae.max()), samples[i][0])
            checked += 1
    per_channel = np.array(per_channel)
    print(json.dumps({
        "checked": checked,
        "mae_per_channel_mean": per_channel.mean(axis=0).tolist() if checked else None,
        "mae_worst_image": worst[0],
        "worst_image": worst[1],
    }))


def check_labels(a):
    classes, samples = image_folder(a.root)
    dump = load_dump(a.dump)
    bad = []
    n = 0
    for (_, _), fields in sorted(dump.items()):
        idx = np.frombuffer(fields["index"], np.int64)
        lab = np.frombuffer(fields["label"], np.int64)
        for i, l in zip(idx, lab):
            n += 1
            if samples[i][1] != l:
                bad.append((int(i), int(l), samples[i]))
    print(json.dumps({"classes": classes, "checked": n, "mismatches": bad[:10], "len": len(samples)}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-folder")
    m.add_argument("root")
    m.add_argument("--bad", action="store_true")
    m.add_argument("--large", action="store_true")
    m.add_argument("--count", type=int, default=3)
    m = sub.add_parser("make-asymmetric")
    m.add_argument("root")
    m.add_argument("n", type=int)
    m = sub.add_parser("make-photos")
    m.add_argument("root")
    m.add_argument("n", type=int)
    m = sub.add_parser("ops-reference")
    m.add_argument("out")
    m.add_argument("w", type=int)
    m.add_argument("h", type=int)
    m.add_argument("seed", type=int)
    m.add_argument("ops")
    m = sub.add_parser("make-shards")
    m.add_argument("root")
    m.add_argument("out")
    m.add_argument("per_shard", type=int)
    m = sub.add_parser("check-eval")
    m.add_argument("dump")
    m.add_argument("root")
    m.add_argument("--resize", type=int, default=0)
    m.add_argument("--crop", type=int, default=0)
    m.add_argument("--whole", type=int, nargs=2, help="W H: reference is the whole image resized")
    m.add_argument("--mean", type=float, nargs=3)
    m.add_argument("--std", type=float, nargs=3)
    m.add_argument("--dtype", default="u8")
    m.add_argument("--ops", help="JSON [[name, magnitude], ...] applied after the crop")
    m.add_argument("--geometry", help="JSON [[resize|center_crop|pad, arg], ...] instead of --resize/--crop")
    m.add_argument("--size", type=int, nargs=2, help="H W of the dumped images")
    m = sub.add_parser("check-random-crop")
    m.add_argument("dump")
    m.add_argument("root")
    m.add_argument("--resize", type=int, nargs=2, help="H W: the exact resize before the crop")
    m.add_argument("--size", type=int, nargs=2, required=True, help="H W of the crop")
    m.add_argument("--padding", type=int, nargs=4, required=True, help="L T R B")
    m.add_argument("--pad-if-needed", action="store_true")
    m.add_argument("--fill", type=int, nargs=3, default=[0, 0, 0])
    m.add_argument("--mode", default="constant")
    m = sub.add_parser("check-labels")
    m.add_argument("dump")
    m.add_argument("root")
    m = sub.add_parser("decode-all")
    m.add_argument("root")
    m.add_argument("out")
    a = p.parse_args()
    if a.cmd == "make-folder":
        make_folder(a.root, a.bad, a.large, a.count)
    elif a.cmd == "make-asymmetric":
        make_asymmetric(a.root, a.n)
    elif a.cmd == "make-photos":
        make_photos(a.root, a.n)
    elif a.cmd == "ops-reference":
        ops_reference(a.out, a.w, a.h, a.seed, a.ops)
    elif a.cmd == "make-shards":
        make_shards(a.root, a.out, a.per_shard)
    elif a.cmd == "check-eval":
        check_eval(a)
    elif a.cmd == "check-random-crop":
        check_random_crop(a)
    elif a.cmd == "check-labels":
        check_labels(a)
    elif a.cmd == "decode-all":
        decode_all(a.root, a.out)


if __name__ == "__main__":
    sys.exit(main())
