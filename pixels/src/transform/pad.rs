//! Padding as torchvision pads PIL images (`np.pad`'s modes), and the
//! window of an image a crop takes, reaching into that padding.

use serde::Deserialize;

/// torchvision's `padding_mode` (on PIL images: `np.pad`'s modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PaddingMode {
    /// The fill value.
    #[default]
    Constant,
    /// The nearest edge pixel, repeated.
    Edge,
    /// Mirrored without repeating the edge: `d c b | a b c d | c b a`.
    Reflect,
    /// Mirrored with the edge: `c b a | a b c d | d c b`.
    Symmetric,
}

/// An axis's padding steps, in turn: `(before, after)` each.
pub type Steps = [(i64, i64); 2];

/// What a padding puts outside an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Border {
    pub mode: PaddingMode,
    /// Per channel, for [`PaddingMode::Constant`].
    pub fill: [u8; 3],
}

impl Border {
    /// Which of `n` pixels position `i` (outside `0..n`) shows, or `None`
    /// for the fill.
    fn fold(self, i: i64, n: i64) -> Option<i64> {
        Some(match self.mode {
            PaddingMode::Constant => return None,
            PaddingMode::Edge => i.clamp(0, n - 1),
            PaddingMode::Reflect if n == 1 => 0,
            PaddingMode::Reflect => {
                let m = i.rem_euclid(2 * (n - 1));
                if m < n { m } else { 2 * (n - 1) - m }
            }
            PaddingMode::Symmetric => {
                let m = i.rem_euclid(2 * n);
                if m < n { m } else { 2 * n - 1 - m }
            }
        })
    }

    /// Which pixel of an axis of `n` position `i` shows after the axis was
    /// padded by `steps` in turn (`(before, after)` each; torchvision pads
    /// a second time for `pad_if_needed`, mirroring the first padding).
    /// `i` counts from the unpadded image's first pixel.
    pub(super) fn source(self, i: i64, n: i64, steps: Steps) -> Option<i64> {
        let [(b1, a1), _] = steps;
        // Into the once-padded axis (starting at -b1), then into the image.
        let mut j = i + b1;
        let n1 = n + b1 + a1;
        if !(0..n1).contains(&j) {
            j = self.fold(j, n1)?;
        }
        let i = j - b1;
        if (0..n).contains(&i) {
            Some(i)
        } else {
            self.fold(i, n)
        }
    }
}

/// `RandomCrop`'s padding steps on an `(ih, iw)` image, per axis
/// (`(before, after)` of `padding`, then of `pad_if_needed`, which pads the
/// shortfall on both sides): `(rows, columns)`.
pub(super) fn random_crop_steps(
    (ih, iw): (u32, u32),
    (h, w): (u32, u32),
    [l, t, r, b]: [u32; 4],
    pad_if_needed: bool,
) -> (Steps, Steps) {
    let axis = |n: u32, before: u32, after: u32, want: u32| {
        let padded = i64::from(n + before + after);
        let extra = if pad_if_needed {
            (i64::from(want) - padded).max(0)
        } else {
            0
        };
        [(i64::from(before), i64::from(after)), (extra, extra)]
    };
    (axis(ih, t, b, h), axis(iw, l, r, w))
}

/// An `oh × ow` window of an RGB image at (`top`, `left`), which may reach
/// outside it: there the image is padded per `border`, in `steps` per axis
/// (`(rows, columns)`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Window {
    pub at: (i64, i64),
    pub size: (u32, u32),
    pub border: Border,
    pub steps: (Steps, Steps),
}

impl Window {
    pub fn copy(&self, src: &[u8], sw: u32, sh: u32, dst: &mut [u8]) {
        let ((top, left), (oh, ow)) = (self.at, self.size);
        let (sw, ow) = (i64::from(sw), ow as usize);
        let fill = self.border.fill;
        // The columns inside the image are one copy per row.
        let x0 = (-left).clamp(0, ow as i64) as usize;
        let x1 = (sw - left).clamp(x0 as i64, ow as i64) as usize;
        for (y, row) in dst.chunks_exact_mut(ow * 3).take(oh as usize).enumerate() {
            let Some(sy) = self
                .border
                .source(top + y as i64, i64::from(sh), self.steps.0)
            else {
                for px in row.chunks_exact_mut(3) {
                    px.copy_from_slice(&fill);
                }
                continue;
            };
            let line = &src[sy as usize * sw as usize * 3..][..sw as usize * 3];
            let start = (left + x0 as i64) as usize * 3;
            row[x0 * 3..x1 * 3].copy_from_slice(&line[start..start + (x1 - x0) * 3]);
            // The few columns in the border, folded back one by one.
            for x in (0..x0).chain(x1..ow) {
                let px = &mut row[x * 3..x * 3 + 3];
                match self.border.source(left + x as i64, sw, self.steps.1) {
                    Some(sx) => px.copy_from_slice(&line[sx as usize * 3..][..3]),
                    None => px.copy_from_slice(&fill),
                }
            }
        }
    }
}
