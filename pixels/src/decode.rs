//! Encoded bytes → RGB8 pixels, converted as PIL's `convert("RGB")` does.
//!
//! JPEG goes through libjpeg-turbo (TurboJPEG 3 API, built from source and
//! linked statically), which can also decode at 1/2, 1/4 or 1/8 size in the
//! DCT domain when the transform will shrink the image anyway. PNG goes
//! through the `png` crate; BMP, PPM/PGM, TIFF and WebP through `image`;
//! GIF (its first frame) through `gif`, whose palette indices are mapped as
//! PIL maps them (a transparent index keeps its palette colour). The format
//! is taken from the bytes, not the file name. Every size check happens on
//! the header, before any pixel buffer is allocated.
//!
//! A JPEG can also be decoded in part: only a [`Region`] the transform
//! will read (its iMCU columns decoded, the rows above skipped, decoding
//! stopped below), into the same place of a buffer of the whole image's
//! size, so the transform reads it with the same arithmetic as a whole
//! decode and writes the same bytes. The region is widened by one iMCU on
//! each side inside the image: TurboJPEG's chroma upsampling blends
//! across iMCU edges, which a cropped row does not have
//! (`pixels/tests/crop_decode.rs` pins it).

use std::io::Cursor;

mod cmyk;
mod restart;
mod tj;
use cmyk::{cmyk_to_rgb, has_adobe_marker};
use restart::{Cut, Cutting, Splicer};
pub use tj::Region;
use tj::{JpegInfo, Tj};

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    #[error("empty file")]
    Empty,
    #[error(
        "not an image format batchcast decodes (JPEG, PNG, BMP, PPM/PGM, TIFF, WebP, GIF); it starts with {0:02x?}"
    )]
    Unsupported(Vec<u8>),
    #[error(
        "{width}×{height} = {} pixels exceeds max_pixels = {limit} (a possible decompression bomb); raise max_pixels if the image is genuine",
        *width as u64 * *height as u64
    )]
    TooLarge { width: u32, height: u32, limit: u64 },
    #[error("corrupt or truncated JPEG: {0}")]
    Jpeg(String),
    #[error("corrupt or truncated PNG: {0}")]
    Png(String),
    #[error("corrupt or truncated {0:?}: {1}")]
    Other(Format, String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Jpeg,
    Png,
    Bmp,
    /// PPM, PGM, PBM (binary and plain).
    Pnm,
    Tiff,
    WebP,
    Gif,
}

impl Format {
    /// The `image` crate's name for the formats it decodes here.
    fn image_format(self) -> Option<image::ImageFormat> {
        Some(match self {
            Format::Bmp => image::ImageFormat::Bmp,
            Format::Pnm => image::ImageFormat::Pnm,
            Format::Tiff => image::ImageFormat::Tiff,
            Format::WebP => image::ImageFormat::WebP,
            Format::Jpeg | Format::Png | Format::Gif => return None,
        })
    }
}

/// What the header says, before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub format: Format,
    pub width: u32,
    pub height: u32,
}

/// A decoded image: `width × height × 3` bytes, row-major RGB.
#[derive(Debug, Default)]
pub struct Rgb {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
    /// Where a decode in part put pixels (`None`: everywhere); the rest
    /// of `data` holds whatever was there.
    pub decoded: Option<Region>,
    /// The last decode was a JPEG cut at its restart markers (only the
    /// MCUs around the region entropy-decoded).
    pub cut: bool,
}

impl Rgb {
    /// Whether `r` holds decoded pixels throughout.
    pub fn has(&self, r: &Region) -> bool {
        let whole = Region {
            x: 0,
            y: 0,
            width: self.width,
            height: self.height,
        };
        whole.holds(r) && self.decoded.is_none_or(|d| d.holds(r))
    }

    /// Sizes `data` for `width × height`, keeping what it holds: a buffer
    /// that must grow is allocated zeroed (pages a decode in part never
    /// writes are then never touched).
    fn size(&mut self, width: usize, height: usize, decoded: Option<Region>) {
        let n = width * height * 3;
        if self.data.capacity() < n {
            self.data = vec![0; n];
        } else {
            self.data.resize(n, 0);
        }
        (self.width, self.height) = (width as u32, height as u32);
        self.decoded = decoded;
    }
}

/// One per pipeline thread: the TurboJPEG handle and scratch buffers.
pub struct Decoder {
    tj: Tj,
    scratch: Vec<u8>,
    splicer: Splicer,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decoder")
    }
}

pub fn sniff(bytes: &[u8]) -> Result<Format, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let pnm = bytes.len() >= 3
        && bytes[0] == b'P'
        && (b'1'..=b'6').contains(&bytes[1])
        && bytes[2].is_ascii_whitespace();
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Ok(Format::Jpeg)
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Ok(Format::Png)
    } else if bytes.starts_with(b"BM") {
        Ok(Format::Bmp)
    } else if pnm {
        Ok(Format::Pnm)
    } else if bytes.starts_with(b"II*\0") || bytes.starts_with(b"MM\0*") {
        Ok(Format::Tiff)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Ok(Format::WebP)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Ok(Format::Gif)
    } else {
        Err(DecodeError::Unsupported(
            bytes[..bytes.len().min(8)].to_vec(),
        ))
    }
}

/// `bytes` (a JPEG) re-encoded losslessly with a restart marker every
/// `mcus` MCUs, as baseline with Huffman tables fitted to it: it decodes
/// to the same pixels, and a decode in part then entropy-decodes only the
/// MCUs around its region, in runs of `mcus` where `mcus` divides the
/// image's MCU row, in whole rows where it is whole rows, and as before
/// otherwise (see the module's notes; `batchcast prepare` uses 1). A
/// lossless JPEG is refused.
pub fn restart_marked(bytes: &[u8], mcus: u16) -> Result<Vec<u8>, DecodeError> {
    tj::with_restarts(bytes, mcus).map_err(DecodeError::Jpeg)
}

impl Decoder {
    pub fn new() -> Result<Decoder, DecodeError> {
        Ok(Decoder {
            tj: Tj::new().map_err(DecodeError::Jpeg)?,
            scratch: Vec::new(),
            splicer: Splicer::default(),
        })
    }

    /// Reads the format and size from the header and checks the pixel limit.
    pub fn header(&mut self, bytes: &[u8], max_pixels: u64) -> Result<Header, DecodeError> {
        let format = sniff(bytes)?;
        let (width, height) = match format {
            Format::Jpeg => match self.tj.header(bytes) {
                Ok(h) => (
                    u32::try_from(h.width).unwrap_or(u32::MAX),
                    u32::try_from(h.height).unwrap_or(u32::MAX),
                ),
                Err(e) => {
                    self.reset()?;
                    return Err(DecodeError::Jpeg(e));
                }
            },
            Format::Png => {
                let reader = png::Decoder::new(Cursor::new(bytes))
                    .read_info()
                    .map_err(|e| DecodeError::Png(e.to_string()))?;
                reader.info().size()
            }
            Format::Gif => {
                let dec = gif_options()
                    .read_info(Cursor::new(bytes))
                    .map_err(|e| DecodeError::Other(format, e.to_string()))?;
                (u32::from(dec.width()), u32::from(dec.height()))
            }
            other => image_reader(bytes, other)
                .into_dimensions()
                .map_err(|e| DecodeError::Other(format, e.to_string()))?,
        };
        if width == 0 || height == 0 {
            return Err(match format {
                Format::Jpeg => DecodeError::Jpeg("zero-sized image".into()),
                Format::Png => DecodeError::Png("zero-sized image".into()),
                other => DecodeError::Other(other, "zero-sized image".into()),
            });
        }
        if width as u64 * height as u64 > max_pixels {
            return Err(DecodeError::TooLarge {
                width,
                height,
                limit: max_pixels,
            });
        }
        Ok(Header {
            format,
            width,
            height,
        })
    }

    /// Decodes into `out`. JPEGs are decoded at `1/denom` of their size
    /// (`denom` ∈ {1, 2, 4, 8}; the output size is rounded up), and only
    /// around `region` of that if given (see the module's notes;
    /// `out.decoded` says where); other formats ignore both. The header
    /// must have come from [`header`](Self::header).
    pub fn decode(
        &mut self,
        bytes: &[u8],
        header: &Header,
        (denom, region): (u32, Option<Region>),
        out: &mut Rgb,
    ) -> Result<(), DecodeError> {
        out.cut = false;
        match header.format {
            Format::Jpeg => {
                let r = self.jpeg(bytes, (denom, region), out);
                if r.is_err() {
                    self.reset()?;
                }
                r
            }
            Format::Png => png_rgb(bytes, out, &mut self.scratch),
            Format::Gif => gif_rgb(bytes, header, out, &mut self.scratch),
            other => {
                let img = image_reader(bytes, other)
                    .decode()
                    .map_err(|e| DecodeError::Other(other, e.to_string()))?;
                dynamic_rgb(img, out);
                Ok(())
            }
        }
    }

    /// A TurboJPEG handle keeps its error state after a corrupt file and
    /// fails every later image with the same message; start a fresh one.
    fn reset(&mut self) -> Result<(), DecodeError> {
        self.tj = Tj::new().map_err(DecodeError::Jpeg)?;
        Ok(())
    }

    fn jpeg(
        &mut self,
        bytes: &[u8],
        (denom, region): (u32, Option<Region>),
        out: &mut Rgb,
    ) -> Result<(), DecodeError> {
        let info = self.tj.header(bytes).map_err(DecodeError::Jpeg)?;
        let (w, h) = info.scaled(denom);
        let mut crop = region.and_then(|r| widened(r, &info, denom));
        // With restart markers, only the MCUs around the region are
        // entropy-decoded: a smaller JPEG of them, decoded whole. Its
        // edges are MCU edges, where chroma upsampling sees no neighbour:
        // that reaches 2 pixels in (a chroma sample upsampled by 2), so the
        // region is widened by `CUT_MARGIN` before the MCUs are chosen.
        let cut = match region.map(|r| self.cut(bytes, r, (w, h), denom)) {
            Some(Cutting::Cut(c)) => Some(c),
            // Markers that line up in a broken scan: the whole image's
            // decode says whether the file is bad, as it would with no
            // crop (a cut or a region might not look where it is broken).
            Some(Cutting::Damaged) => {
                crop = None;
                None
            }
            _ => None,
        };
        let d = denom as usize;
        let (src, info, tj_crop) = match cut {
            Some(c) => {
                let part = &self.splicer.jpeg[..];
                let sub = self.tj.header(part).map_err(DecodeError::Jpeg)?;
                crop = Some(Region {
                    x: (c.x / d) as u32,
                    y: (c.y / d) as u32,
                    width: sub.scaled(denom).0 as u32,
                    height: sub.scaled(denom).1 as u32,
                });
                (part, sub, None)
            }
            None => (bytes, info, crop),
        };
        out.size(w, h, crop);
        out.cut = cut.is_some();
        let r = crop.unwrap_or(Region {
            x: 0,
            y: 0,
            width: w as u32,
            height: h as u32,
        });
        let (x, y, rw, rh) = (
            r.x as usize,
            r.y as usize,
            r.width as usize,
            r.height as usize,
        );
        let at = (y * w + x) * 3;
        if !info.cmyk {
            return self
                .tj
                .decompress(src, &info, denom, tj_crop, (&mut out.data[at..], w * 3))
                .map_err(DecodeError::Jpeg);
        }
        // TurboJPEG only decodes CMYK and YCCK to CMYK; convert like PIL.
        self.scratch.resize(rw * rh * 4, 0);
        self.tj
            .decompress(src, &info, denom, tj_crop, (&mut self.scratch, rw * 4))
            .map_err(DecodeError::Jpeg)?;
        let inverted = has_adobe_marker(bytes);
        for (row, src) in self.scratch.chunks_exact(rw * 4).enumerate() {
            let o = ((y + row) * w + x) * 3;
            cmyk_to_rgb(src, &mut out.data[o..o + rw * 3], inverted);
        }
        Ok(())
    }
}

impl Decoder {
    /// Cuts the MCUs around `r` (in the `w × h` image at `1/denom`,
    /// widened by [`CUT_MARGIN`]) out of `bytes` into the splicer.
    fn cut(&mut self, bytes: &[u8], r: Region, (w, h): (usize, usize), denom: u32) -> Cutting {
        let (x0, y0) = (
            r.x.saturating_sub(CUT_MARGIN),
            r.y.saturating_sub(CUT_MARGIN),
        );
        let x1 = (r.x.saturating_add(r.width).saturating_add(CUT_MARGIN)).min(w as u32);
        let y1 = (r.y.saturating_add(r.height).saturating_add(CUT_MARGIN)).min(h as u32);
        let full = |v: u32| v as usize * denom as usize;
        let want = Cut {
            x: full(x0),
            y: full(y0),
            width: full(x1.saturating_sub(x0)),
            height: full(y1.saturating_sub(y0)),
        };
        self.splicer.cut(bytes, want)
    }
}

/// Pixels (at the decode's scale) kept between a region and the edge of
/// the MCUs cut for it: twice what chroma upsampling reaches.
const CUT_MARGIN: u32 = 4;

/// `r` (in the image at `1/denom`) widened to what is decoded for it: one
/// iMCU more on each side within the image, the left edge on an iMCU
/// boundary (TurboJPEG's rule). `None`: decode the whole image (a sampling
/// TurboJPEG cannot crop, a lossless JPEG, or a region covering it all).
fn widened(r: Region, info: &JpegInfo, denom: u32) -> Option<Region> {
    let (mw, mh) = info.imcu(denom).filter(|_| !info.lossless)?;
    let (w, h) = info.scaled(denom);
    let (mw, mh) = (mw as u32, mh as u32);
    let (w, h) = (u32::try_from(w).ok()?, u32::try_from(h).ok()?);
    let x0 = r.x.saturating_sub(mw) / mw * mw;
    let y0 = r.y.saturating_sub(mh);
    let x1 = r.x.saturating_add(r.width).saturating_add(mw).min(w);
    let y1 = r.y.saturating_add(r.height).saturating_add(mh).min(h);
    (x1 > x0 && y1 > y0 && (x0, y0, x1, y1) != (0, 0, w, h)).then_some(Region {
        x: x0,
        y: y0,
        width: x1 - x0,
        height: y1 - y0,
    })
}

/// A reader of `bytes` as `format` (one `image` decodes), with `image`'s
/// own allocation limit as a second guard behind `max_pixels`.
fn image_reader(bytes: &[u8], format: Format) -> image::ImageReader<Cursor<&[u8]>> {
    let mut r = image::ImageReader::with_format(
        Cursor::new(bytes),
        format.image_format().expect("a format image decodes"),
    );
    r.limits(image::Limits::default());
    r
}

/// Any decoded image → RGB8 as PIL's `convert("RGB")` gives it: alpha
/// dropped (not composited), grey replicated, 16-bit grey *clamped* to 255
/// (PIL's `I;16` → `L`), 16-bit colour reduced to its high byte, float
/// scaled from 0..1.
fn dynamic_rgb(img: image::DynamicImage, out: &mut Rgb) {
    use image::DynamicImage as D;
    let (w, h) = (img.width(), img.height());
    out.decoded = None;
    out.width = w;
    out.height = h;
    out.data.resize(w as usize * h as usize * 3, 0);
    let dst = out.data.chunks_exact_mut(3);
    match img {
        D::ImageRgb8(b) => out.data.copy_from_slice(b.as_raw()),
        D::ImageRgba8(b) => {
            for (p, d) in b.as_raw().chunks_exact(4).zip(dst) {
                d.copy_from_slice(&p[..3]);
            }
        }
        D::ImageLuma8(b) => {
            for (&v, d) in b.as_raw().iter().zip(dst) {
                d.fill(v);
            }
        }
        D::ImageLumaA8(b) => {
            for (p, d) in b.as_raw().chunks_exact(2).zip(dst) {
                d.fill(p[0]);
            }
        }
        D::ImageLuma16(b) => {
            for (&v, d) in b.as_raw().iter().zip(dst) {
                d.fill(v.min(255) as u8);
            }
        }
        D::ImageLumaA16(b) => {
            for (p, d) in b.as_raw().chunks_exact(2).zip(dst) {
                d.fill(p[0].min(255) as u8);
            }
        }
        D::ImageRgb16(b) => {
            for (p, d) in b.as_raw().chunks_exact(3).zip(dst) {
                for c in 0..3 {
                    d[c] = (p[c] >> 8) as u8;
                }
            }
        }
        D::ImageRgba16(b) => {
            for (p, d) in b.as_raw().chunks_exact(4).zip(dst) {
                for c in 0..3 {
                    d[c] = (p[c] >> 8) as u8;
                }
            }
        }
        other => out.data.copy_from_slice(other.to_rgb8().as_raw()),
    }
}

fn gif_options() -> gif::DecodeOptions {
    let mut o = gif::DecodeOptions::new();
    o.set_color_output(gif::ColorOutput::Indexed);
    o
}

/// A GIF's first frame → RGB8 as PIL gives it: each index through the
/// frame's palette (else the global one), a transparent index to its
/// palette colour; the rest of the logical screen, if the frame does not
/// cover it, in the background colour.
fn gif_rgb(
    bytes: &[u8],
    header: &Header,
    out: &mut Rgb,
    scratch: &mut Vec<u8>,
) -> Result<(), DecodeError> {
    let err = |e: gif::DecodingError| DecodeError::Other(Format::Gif, e.to_string());
    let mut dec = gif_options().read_info(Cursor::new(bytes)).map_err(err)?;
    let global = dec.global_palette().map(<[u8]>::to_vec).unwrap_or_default();
    let bg = dec.bg_color().unwrap_or(0);
    let frame = dec
        .next_frame_info()
        .map_err(err)?
        .ok_or_else(|| DecodeError::Other(Format::Gif, "no image in the file".into()))?;
    let (fx, fy) = (usize::from(frame.left), usize::from(frame.top));
    let (fw, fh) = (usize::from(frame.width), usize::from(frame.height));
    let palette = frame.palette.clone().unwrap_or(global);
    scratch.resize(fw * fh, 0);
    dec.read_into_buffer(scratch).map_err(err)?;
    let colour = |i: usize| -> [u8; 3] {
        palette
            .get(3 * i..3 * i + 3)
            .map_or([0, 0, 0], |c| [c[0], c[1], c[2]])
    };
    let (w, h) = (header.width as usize, header.height as usize);
    out.decoded = None;
    out.width = header.width;
    out.height = header.height;
    out.data.clear();
    out.data.reserve(w * h * 3);
    let back = colour(bg);
    for y in 0..h {
        for x in 0..w {
            let inside = (fx..fx + fw).contains(&x) && (fy..fy + fh).contains(&y);
            let c = if inside {
                colour(usize::from(scratch[(y - fy) * fw + (x - fx)]))
            } else {
                back
            };
            out.data.extend_from_slice(&c);
        }
    }
    Ok(())
}

/// PNG → RGB8 as PIL converts it: palette expanded, alpha dropped (not
/// composited), low bit depths scaled up, 16-bit colour reduced to its high
/// byte, and 16-bit grayscale *clamped* to 255 (PIL's `I;16` → `L`), which
/// is what a torchvision user gets.
fn png_rgb(bytes: &[u8], out: &mut Rgb, scratch: &mut Vec<u8>) -> Result<(), DecodeError> {
    let err = |e: png::DecodingError| DecodeError::Png(e.to_string());
    let mut dec = png::Decoder::new(Cursor::new(bytes));
    dec.set_transformations(png::Transformations::EXPAND);
    let mut reader = dec.read_info().map_err(err)?;
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| DecodeError::Png("image too large".into()))?;
    scratch.resize(size, 0);
    let frame = reader.next_frame(scratch).map_err(err)?;
    let (w, h) = (frame.width as usize, frame.height as usize);
    let px = &scratch[..frame.buffer_size()];
    out.decoded = None;
    out.width = w as u32;
    out.height = h as u32;
    out.data.resize(w * h * 3, 0);
    let wide = frame.bit_depth == png::BitDepth::Sixteen;
    let bps = if wide { 2 } else { 1 };
    let channels = frame.color_type.samples();
    let stride = bps * channels;
    let high = |p: &[u8], c: usize| p[c * bps];
    for (p, dst) in px.chunks_exact(stride).zip(out.data.chunks_exact_mut(3)) {
        match frame.color_type {
            png::ColorType::Grayscale | png::ColorType::GrayscaleAlpha => {
                let v = if wide {
                    u16::from_be_bytes([p[0], p[1]]).min(255) as u8
                } else {
                    p[0]
                };
                dst.fill(v);
            }
            _ => {
                for (c, d) in dst.iter_mut().enumerate() {
                    *d = high(p, c);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbojpeg::{Image, PixelFormat};

    #[test]
    fn cmyk_conversion_matches_pil_on_corners() {
        let mut rgb = [0u8; 3];
        // No ink is white; full black is black; full cyan removes red.
        cmyk_to_rgb(&[0, 0, 0, 0], &mut rgb, false);
        assert_eq!(rgb, [255, 255, 255]);
        cmyk_to_rgb(&[0, 0, 0, 255], &mut rgb, false);
        assert_eq!(rgb, [0, 0, 0]);
        cmyk_to_rgb(&[255, 0, 0, 0], &mut rgb, false);
        assert_eq!(rgb, [0, 255, 255]);
        // Inverted storage: stored 255 means no ink.
        cmyk_to_rgb(&[255, 255, 255, 255], &mut rgb, true);
        assert_eq!(rgb, [255, 255, 255]);
    }

    #[test]
    fn a_corrupt_jpeg_does_not_poison_the_next_one() {
        let mut c = turbojpeg::Compressor::new().unwrap();
        let px = vec![128u8; 16 * 16 * 3];
        let img = Image {
            pixels: &px[..],
            width: 16,
            pitch: 48,
            height: 16,
            format: PixelFormat::RGB,
        };
        let good = c.compress_to_vec(img).unwrap();
        // Garbage in the entropy-coded data, after the start of scan.
        let mut bad = good.clone();
        let sos = bad.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
        let n = bad.len();
        bad[sos + 14..n - 2].fill(0x1F);
        let mut d = Decoder::new().unwrap();
        let mut out = Rgb::default();
        let h = d.header(&bad, u64::MAX).unwrap();
        assert!(d.decode(&bad, &h, (1, None), &mut out).is_err());
        let h = d.header(&good, u64::MAX).unwrap();
        d.decode(&good, &h, (1, None), &mut out).unwrap();
        assert_eq!((out.width, out.height), (16, 16));
        assert!(out.data.iter().all(|&v| v.abs_diff(128) <= 1));
    }

    #[test]
    fn garbage_is_named_not_decoded() {
        let mut d = Decoder::new().unwrap();
        assert_eq!(d.header(b"", 100), Err(DecodeError::Empty));
        assert!(matches!(
            d.header(b"\x00\x00\x01\x00 an icon", 100),
            Err(DecodeError::Unsupported(_))
        ));
        assert!(matches!(
            d.header(b"GIF89a....", 100),
            Err(DecodeError::Other(Format::Gif, _))
        ));
        assert!(matches!(
            d.header(&[0xFF, 0xD8, 0xFF, 0xE0, 0, 0], 100),
            Err(DecodeError::Jpeg(_))
        ));
    }
}
