//! The tensor a sample becomes: `ToTensor` + `Normalize` through one
//! table per channel, in the output's dtype and layout.

use batchcast_core::DType;

use super::{Layout, Transform};

/// What one input byte becomes in each channel, for every output dtype.
#[derive(Debug, Clone)]
pub struct Lut {
    /// Indexed by `channel * 256 + value`; holds the output element's bytes.
    pub(super) bytes: Vec<[u8; 4]>,
    pub(super) size: usize,
}

impl Lut {
    pub fn new(t: &Transform) -> Lut {
        let size = t.dtype.size() as usize;
        let mut bytes = vec![[0u8; 4]; 3 * 256];
        for c in 0..3 {
            for v in 0..256usize {
                let x = match t.normalize {
                    Some((mean, std)) => ((v as f64 / 255.0) - mean[c]) / std[c],
                    None => v as f64 / 255.0,
                };
                let e = &mut bytes[c * 256 + v];
                match t.dtype {
                    DType::U8 => e[0] = v as u8,
                    DType::F32 => e.copy_from_slice(&(x as f32).to_le_bytes()),
                    DType::F16 => e[..2].copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
                    DType::Bf16 => e[..2].copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
                    _ => unreachable!("validated in config"),
                }
            }
        }
        Lut { bytes, size }
    }

    /// Bytes of one output element.
    pub fn element_bytes(&self) -> usize {
        self.size
    }

    /// Writes `src`, tensors of `u8` values in `layout` with `hw` pixels
    /// each (what the same transform makes with `dtype = "u8"` and no
    /// normalisation), as this table's elements into `out`: the bytes the
    /// transform itself writes. `out` holds `src.len()` elements; a
    /// shorter one is filled as far as it goes.
    pub fn expand(&self, layout: Layout, hw: usize, src: &[u8], out: &mut [u8]) {
        let n = self.size;
        match layout {
            // A channel's plane is contiguous: one table for the plane.
            Layout::Nchw => {
                for (k, (plane, o)) in src
                    .chunks(hw.max(1))
                    .zip(out.chunks_mut(hw.max(1) * n))
                    .enumerate()
                {
                    let table = &self.bytes[(k % 3) * 256..(k % 3 + 1) * 256];
                    expand_plane(table, n, plane, o);
                }
            }
            Layout::Nhwc => {
                for (px, o) in src.chunks_exact(3).zip(out.chunks_exact_mut(3 * n)) {
                    for c in 0..3 {
                        let e = &self.bytes[c * 256 + px[c] as usize];
                        o[c * n..(c + 1) * n].copy_from_slice(&e[..n]);
                    }
                }
            }
        }
    }
}

/// `plane`'s values through one channel's `table` (elements of `n`
/// bytes) into `out`.
fn expand_plane(table: &[[u8; 4]], n: usize, plane: &[u8], out: &mut [u8]) {
    if n == 4 {
        for (&v, e) in plane.iter().zip(out.chunks_exact_mut(4)) {
            e.copy_from_slice(&table[v as usize]);
        }
    } else {
        for (&v, e) in plane.iter().zip(out.chunks_exact_mut(n)) {
            e.copy_from_slice(&table[v as usize][..n]);
        }
    }
}

/// HWC u8 → the output tensor, flipping horizontally if asked.
///
/// One pass over the source: each pixel's three channels go to their three
/// planes (NCHW) or stay together (NHWC) in the same step. `u8` output is
/// the identity table, so it is copied without a lookup (NHWC unflipped is
/// one copy).
pub(super) fn write_tensor(
    src: &[u8],
    h: u32,
    w: u32,
    flip: bool,
    layout: Layout,
    lut: &Lut,
    out: &mut [u8],
) {
    let (h, w) = (h as usize, w as usize);
    let src = &src[..h * w * 3];
    match (lut.size, layout) {
        (1, Layout::Nhwc) if !flip => out[..src.len()].copy_from_slice(src),
        (1, _) => write_tensor_n::<1, false>(src, w, flip, layout, lut, out),
        (2, _) => write_tensor_n::<2, true>(src, w, flip, layout, lut, out),
        (4, _) => write_tensor_n::<4, true>(src, w, flip, layout, lut, out),
        (n, _) => unreachable!("no image dtype of {n} bytes"),
    }
}

/// `N` is the element size, known at compile time so each store is one
/// move; `LOOKUP` is false for `u8`, whose table is the identity.
fn write_tensor_n<const N: usize, const LOOKUP: bool>(
    src: &[u8],
    w: usize,
    flip: bool,
    layout: Layout,
    lut: &Lut,
    out: &mut [u8],
) {
    // One 256-entry table per channel, as arrays: a u8 index needs no
    // bounds check.
    let t: [&[[u8; 4]; 256]; 3] = std::array::from_fn(|c| {
        lut.bytes[c * 256..(c + 1) * 256]
            .try_into()
            .expect("a table of 256 entries per channel")
    });
    let rows = src.chunks_exact(w * 3).map(|row| row.as_chunks::<3>().0);
    if layout == Layout::Nhwc {
        for (dst, px) in out.chunks_exact_mut(w * 3 * N).zip(rows) {
            match flip {
                true => pixels_row::<N, LOOKUP>(px.iter().rev(), &t, dst),
                false => pixels_row::<N, LOOKUP>(px.iter(), &t, dst),
            }
        }
        return;
    }
    let plane = src.len() / 3 * N;
    let (r, rest) = out[..3 * plane].split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    let planes = r.chunks_exact_mut(w * N).zip(g.chunks_exact_mut(w * N));
    for ((r, g), (b, px)) in planes.zip(b.chunks_exact_mut(w * N).zip(rows)) {
        if !LOOKUP {
            // u8: a plain de-interleave, in blocks; a flip reverses the
            // planes' rows after (a vectorized reverse).
            deinterleave(px.as_flattened(), r, g, b);
            if flip {
                r.reverse();
                g.reverse();
                b.reverse();
            }
            continue;
        }
        match flip {
            true => planes_row::<N>(px.iter().rev(), &t, [r, g, b]),
            false => planes_row::<N>(px.iter(), &t, [r, g, b]),
        }
    }
}

/// One row's pixels, in output order, through the tables into the
/// three planes' rows (NCHW).
#[inline(always)]
fn planes_row<'a, const N: usize>(
    px: impl Iterator<Item = &'a [u8; 3]>,
    t: &[&[[u8; 4]; 256]; 3],
    [r, g, b]: [&mut [u8]; 3],
) {
    let (r, g, b) = (
        r.as_chunks_mut::<N>().0,
        g.as_chunks_mut::<N>().0,
        b.as_chunks_mut::<N>().0,
    );
    for (((p, r), g), b) in px.zip(r).zip(g).zip(b) {
        r.copy_from_slice(&t[0][p[0] as usize][..N]);
        g.copy_from_slice(&t[1][p[1] as usize][..N]);
        b.copy_from_slice(&t[2][p[2] as usize][..N]);
    }
}

/// One row's pixels, in output order, into an NHWC row.
#[inline(always)]
fn pixels_row<'a, const N: usize, const LOOKUP: bool>(
    px: impl Iterator<Item = &'a [u8; 3]>,
    t: &[&[[u8; 4]; 256]; 3],
    dst: &mut [u8],
) {
    for (p, d) in px.zip(dst.chunks_exact_mut(3 * N)) {
        for c in 0..3 {
            match LOOKUP {
                true => d[c * N..(c + 1) * N].copy_from_slice(&t[c][p[c] as usize][..N]),
                false => d[c] = p[c],
            }
        }
    }
}

/// One row of RGB pixels into its three planes' rows.
fn deinterleave(row: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) {
    const B: usize = 16;
    let n = r.len() / B * B;
    let blocks = row[..n * 3].chunks_exact(3 * B);
    let planes = r[..n].chunks_exact_mut(B).zip(g[..n].chunks_exact_mut(B));
    for (px, ((r, g), b)) in blocks.zip(planes.zip(b[..n].chunks_exact_mut(B))) {
        for i in 0..B {
            r[i] = px[3 * i];
            g[i] = px[3 * i + 1];
            b[i] = px[3 * i + 2];
        }
    }
    for (i, px) in row[n * 3..].chunks_exact(3).enumerate() {
        (r[n + i], g[n + i], b[n + i]) = (px[0], px[1], px[2]);
    }
}
