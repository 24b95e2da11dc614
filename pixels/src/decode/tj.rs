//! TurboJPEG's decompressor through its C API (`turbojpeg::raw`), for what
//! the `turbojpeg` crate's safe `Decompressor` does not offer: a cropping
//! region (`tj3SetCroppingRegion`: only the iMCU columns it covers are
//! decoded, rows above it are skipped, decoding stops below it) written
//! into a region of a larger buffer (`tj3Decompress8` with a pitch).
//!
//! Every call goes through [`Tj`]; the destination buffer is checked to
//! hold every byte the call writes before TurboJPEG is handed its pointer.
//! This is the crate's only `unsafe` module.

use std::ffi::{CStr, c_int};
use std::ptr::NonNull;

use turbojpeg::raw;

/// A TurboJPEG decompression handle. Not shareable between threads (its
/// error state is per handle); it may move to another thread.
pub(super) struct Tj {
    ptr: NonNull<std::ffi::c_void>,
}

// SAFETY: a TurboJPEG handle holds no thread-local state; it is used by one
// thread at a time (every method takes `&mut self`).
unsafe impl Send for Tj {}

impl Drop for Tj {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `tj3Init` and is destroyed once, here.
        unsafe { raw::tj3Destroy(self.ptr.as_ptr()) }
    }
}

/// What a JPEG's header says, for decoding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct JpegInfo {
    pub width: usize,
    pub height: usize,
    /// TurboJPEG's `TJSAMP_*` (-1: a sampling it does not name).
    pub subsamp: i32,
    /// Decoded as CMYK (CMYK or YCCK JPEGs), 4 bytes per pixel.
    pub cmyk: bool,
    pub lossless: bool,
}

impl JpegInfo {
    /// The image's size decoded at `1/denom` (TurboJPEG's `TJSCALED`:
    /// rounded up).
    pub fn scaled(&self, denom: u32) -> (usize, usize) {
        let d = denom as usize;
        (self.width.div_ceil(d), self.height.div_ceil(d))
    }

    /// The iMCU (width, height) at `1/denom`, or `None` for a sampling
    /// TurboJPEG cannot crop (then the whole image is decoded).
    pub fn imcu(&self, denom: u32) -> Option<(usize, usize)> {
        // tjMCUWidth / tjMCUHeight, by TJSAMP_444, 422, 420, GRAY, 440,
        // 411, 441.
        const W: [usize; 7] = [8, 16, 16, 8, 8, 32, 8];
        const H: [usize; 7] = [8, 8, 16, 8, 16, 8, 32];
        let s = usize::try_from(self.subsamp).ok().filter(|&s| s < 7)?;
        let d = denom as usize;
        Some((W[s].div_ceil(d), H[s].div_ceil(d)))
    }
}

/// A rectangle of the image as decoded (at its scale), in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

impl Region {
    /// The smallest region holding both.
    pub fn union(self, o: Region) -> Region {
        let (x, y) = (self.x.min(o.x), self.y.min(o.y));
        let right = (self.x + self.width).max(o.x + o.width);
        let bottom = (self.y + self.height).max(o.y + o.height);
        Region {
            x,
            y,
            width: right - x,
            height: bottom - y,
        }
    }

    /// Whether `o` lies inside this one.
    pub fn holds(&self, o: &Region) -> bool {
        o.x >= self.x
            && o.y >= self.y
            && o.x + o.width <= self.x + self.width
            && o.y + o.height <= self.y + self.height
    }
}

impl Tj {
    pub fn new() -> Result<Tj, String> {
        // SAFETY: no preconditions; a null return is handled.
        let ptr = unsafe { raw::tj3Init(raw::TJINIT_TJINIT_DECOMPRESS as c_int) };
        NonNull::new(ptr)
            .map(|ptr| Tj { ptr })
            .ok_or_else(|| "TurboJPEG could not make a decompressor".to_string())
    }

    /// The handle's last error.
    fn error(&mut self) -> String {
        // SAFETY: a live handle; TurboJPEG returns a NUL-terminated string
        // it owns, valid until the next call on the handle, copied here.
        unsafe { CStr::from_ptr(raw::tj3GetErrorStr(self.ptr.as_ptr())) }
            .to_string_lossy()
            .into_owned()
    }

    fn get(&mut self, param: raw::TJPARAM) -> c_int {
        // SAFETY: a live handle; reading a parameter has no preconditions.
        unsafe { raw::tj3Get(self.ptr.as_ptr(), param as c_int) }
    }

    /// Reads `bytes`' header (and leaves it read, as the decompression
    /// parameters need).
    pub fn header(&mut self, bytes: &[u8]) -> Result<JpegInfo, String> {
        // SAFETY: a live handle; `bytes` is valid for its length.
        let r = unsafe {
            raw::tj3DecompressHeader(self.ptr.as_ptr(), bytes.as_ptr(), bytes.len() as _)
        };
        if r != 0 {
            return Err(self.error());
        }
        let cs = self.get(raw::TJPARAM_TJPARAM_COLORSPACE) as raw::TJCS;
        let dim = |v: c_int| usize::try_from(v).unwrap_or(0);
        Ok(JpegInfo {
            width: dim(self.get(raw::TJPARAM_TJPARAM_JPEGWIDTH)),
            height: dim(self.get(raw::TJPARAM_TJPARAM_JPEGHEIGHT)),
            subsamp: self.get(raw::TJPARAM_TJPARAM_SUBSAMP),
            cmyk: cs == raw::TJCS_TJCS_CMYK || cs == raw::TJCS_TJCS_YCCK,
            lossless: self.get(raw::TJPARAM_TJPARAM_LOSSLESS) != 0,
        })
    }

    /// Decodes `bytes` (whose header is `info`) at `1/denom`, only `crop`
    /// of it if given (its `x` a multiple of the scaled iMCU width), into
    /// `dst`: rows of `pitch` bytes, RGB (or CMYK where `info.cmyk`), the
    /// first pixel at `dst[0]`.
    pub fn decompress(
        &mut self,
        bytes: &[u8],
        info: &JpegInfo,
        denom: u32,
        crop: Option<Region>,
        (dst, pitch): (&mut [u8], usize),
    ) -> Result<(), String> {
        // The region needs this image's header read on the handle.
        if self.header(bytes)? != *info {
            return Err("the JPEG's header changed between reads".into());
        }
        if info.lossless && (denom != 1 || crop.is_some()) {
            return Err("a lossless JPEG cannot be decoded at reduced size or in part".into());
        }
        check_destination(info, denom, crop, (dst.len(), pitch))?;
        let factor = raw::tjscalingfactor {
            num: 1,
            denom: denom as c_int,
        };
        let region = crop.map_or(
            raw::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            },
            |r| raw::tjregion {
                x: r.x as c_int,
                y: r.y as c_int,
                w: r.width as c_int,
                h: r.height as c_int,
            },
        );
        let format = if info.cmyk {
            raw::TJPF_TJPF_CMYK
        } else {
            raw::TJPF_TJPF_RGB
        };
        // SAFETY: a live handle whose header is read (the region's
        // precondition). TurboJPEG writes `h` rows of `w × px` bytes,
        // `pitch` apart, from `dst`'s start: checked above to lie within
        // `dst`, which is borrowed mutably for the call. `bytes` is valid
        // for its length.
        let r = unsafe {
            let p = self.ptr.as_ptr();
            if raw::tj3SetScalingFactor(p, factor) != 0 || raw::tj3SetCroppingRegion(p, region) != 0
            {
                -1
            } else {
                raw::tj3Decompress8(
                    p,
                    bytes.as_ptr(),
                    bytes.len() as _,
                    dst.as_mut_ptr(),
                    pitch as c_int,
                    format as c_int,
                )
            }
        };
        if r != 0 {
            return Err(self.error());
        }
        Ok(())
    }
}

/// Checks that decoding `info` at `1/denom` (only `crop` of it, if given)
/// writes within a destination of `len` bytes at `pitch`: the region
/// inside the scaled image, its left edge on an iMCU boundary, every row's
/// last byte before `len`.
fn check_destination(
    info: &JpegInfo,
    denom: u32,
    crop: Option<Region>,
    (len, pitch): (usize, usize),
) -> Result<(), String> {
    let (sw, sh) = info.scaled(denom);
    let (w, h) = match crop {
        Some(r) => (r.width as usize, r.height as usize),
        None => (sw, sh),
    };
    let px = if info.cmyk { 4 } else { 3 };
    let fits = crop.is_none_or(|r| {
        r.x as usize + w <= sw
            && r.y as usize + h <= sh
            && info
                .imcu(denom)
                .is_some_and(|(mw, _)| (r.x as usize).is_multiple_of(mw))
    });
    let last_row = (h.max(1) - 1).checked_mul(pitch);
    let needed = last_row.and_then(|l| l.checked_add(w * px));
    if !fits
        || w == 0
        || h == 0
        || pitch < w * px
        || needed.is_none_or(|n| n > len)
        || c_int::try_from(pitch).is_err()
        || c_int::try_from(sw.max(sh)).is_err()
    {
        return Err(format!(
            "cannot decode {crop:?} of a {sw}×{sh} image into {len} bytes at a pitch of {pitch}"
        ));
    }
    Ok(())
}

/// Re-encodes `bytes` losslessly (TurboJPEG's transform: the DCT
/// coefficients as they are, so the pixels decoded are the same) as a
/// baseline JPEG with Huffman tables fitted to it and a restart marker
/// every `blocks` MCUs, its other markers kept.
pub(super) fn with_restarts(bytes: &[u8], blocks: u16) -> Result<Vec<u8>, String> {
    // SAFETY: no preconditions; a null return is handled.
    let ptr = unsafe { raw::tj3Init(raw::TJINIT_TJINIT_TRANSFORM as c_int) };
    let mut handle = NonNull::new(ptr)
        .map(|ptr| Tj { ptr })
        .ok_or_else(|| "TurboJPEG could not make a transformer".to_string())?;
    let transform = raw::tjtransform {
        r: raw::tjregion {
            x: 0,
            y: 0,
            w: 0,
            h: 0,
        },
        op: raw::TJXOP_TJXOP_NONE as c_int,
        options: 0,
        data: std::ptr::null_mut(),
        customFilter: None,
    };
    let (mut out, mut len): (*mut u8, raw::size_t) = (std::ptr::null_mut(), 0);
    // SAFETY: a live transform handle. `bytes` is valid for its length;
    // `out` starts null with NOREALLOC off, so TurboJPEG allocates it and
    // sets `len`; one transform is passed for the one destination.
    let r = unsafe {
        let p = handle.ptr.as_ptr();
        let set = |param: raw::TJPARAM, v: c_int| raw::tj3Set(p, param as c_int, v);
        if set(raw::TJPARAM_TJPARAM_NOREALLOC, 0) != 0
            || set(raw::TJPARAM_TJPARAM_RESTARTBLOCKS, c_int::from(blocks)) != 0
            || set(raw::TJPARAM_TJPARAM_OPTIMIZE, 1) != 0
            || set(raw::TJPARAM_TJPARAM_PROGRESSIVE, 0) != 0
        {
            -1
        } else {
            raw::tj3Transform(
                p,
                bytes.as_ptr(),
                bytes.len() as _,
                1,
                &mut out,
                &mut len,
                &transform,
            )
        }
    };
    let result = if r != 0 || out.is_null() {
        Err(handle.error())
    } else {
        // SAFETY: TurboJPEG wrote `len` bytes at `out`, which it allocated.
        Ok(unsafe { std::slice::from_raw_parts(out, len as usize) }.to_vec())
    };
    if !out.is_null() {
        // SAFETY: `out` came from TurboJPEG's allocator and is freed once.
        unsafe { raw::tj3Free(out.cast()) };
    }
    result
}
