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

use std::io::Cursor;

use turbojpeg::{Colorspace, Decompressor, Image, PixelFormat, ScalingFactor};

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
}

/// One per pipeline thread: the TurboJPEG handle and scratch buffers.
pub struct Decoder {
    tj: Decompressor,
    scratch: Vec<u8>,
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

impl Decoder {
    pub fn new() -> Result<Decoder, DecodeError> {
        Ok(Decoder {
            tj: Decompressor::new().map_err(|e| DecodeError::Jpeg(e.to_string()))?,
            scratch: Vec::new(),
        })
    }

    /// Reads the format and size from the header and checks the pixel limit.
    pub fn header(&mut self, bytes: &[u8], max_pixels: u64) -> Result<Header, DecodeError> {
        let format = sniff(bytes)?;
        let (width, height) = match format {
            Format::Jpeg => match self.tj.read_header(bytes) {
                Ok(h) => (h.width as u32, h.height as u32),
                Err(e) => {
                    self.reset()?;
                    return Err(DecodeError::Jpeg(e.to_string()));
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
    /// (`denom` ∈ {1, 2, 4, 8}; the output size is rounded up); PNGs ignore
    /// `denom`. The header must have come from [`header`](Self::header).
    pub fn decode(
        &mut self,
        bytes: &[u8],
        header: &Header,
        denom: u32,
        out: &mut Rgb,
    ) -> Result<(), DecodeError> {
        match header.format {
            Format::Jpeg => {
                let r = self.jpeg(bytes, denom, out);
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
        self.tj = Decompressor::new().map_err(|e| DecodeError::Jpeg(e.to_string()))?;
        Ok(())
    }

    fn jpeg(&mut self, bytes: &[u8], denom: u32, out: &mut Rgb) -> Result<(), DecodeError> {
        let err = |e: turbojpeg::Error| DecodeError::Jpeg(e.to_string());
        let scale = ScalingFactor::new(1, denom as usize);
        self.tj.set_scaling_factor(scale).map_err(err)?;
        let header = self.tj.read_header(bytes).map_err(err)?;
        let scaled = header.scaled(scale);
        let (w, h) = (scaled.width, scaled.height);
        out.width = w as u32;
        out.height = h as u32;
        out.data.resize(w * h * 3, 0);
        match header.colorspace {
            Colorspace::CMYK | Colorspace::YCCK => {
                // TurboJPEG only decodes these to CMYK; convert like PIL.
                self.scratch.resize(w * h * 4, 0);
                let image = Image {
                    pixels: &mut self.scratch[..],
                    width: w,
                    pitch: w * 4,
                    height: h,
                    format: PixelFormat::CMYK,
                };
                self.tj.decompress(bytes, image).map_err(err)?;
                cmyk_to_rgb(&self.scratch, &mut out.data, has_adobe_marker(bytes));
            }
            _ => {
                let image = Image {
                    pixels: &mut out.data[..],
                    width: w,
                    pitch: w * 3,
                    height: h,
                    format: PixelFormat::RGB,
                };
                self.tj.decompress(bytes, image).map_err(err)?;
            }
        }
        Ok(())
    }
}

/// PIL's CMYK → RGB: `R = 255 - K' - C'·(255 - K')/255` with primes the
/// CMYK values PIL holds. Adobe's JPEGs store inverted CMYK, which PIL
/// reads as `CMYK;I`, so its values are `255 - stored`.
fn cmyk_to_rgb(cmyk: &[u8], rgb: &mut [u8], adobe_inverted: bool) {
    for (src, dst) in cmyk.chunks_exact(4).zip(rgb.chunks_exact_mut(3)) {
        let inv = |v: u8| if adobe_inverted { 255 - v } else { v };
        let nk = 255 - inv(src[3]) as i32;
        for c in 0..3 {
            let v = inv(src[c]) as i32;
            // MULDIV255(a, b) = ((a*b + 128) + ((a*b + 128) >> 8)) >> 8
            let t = v * nk + 128;
            let m = (t + (t >> 8)) >> 8;
            dst[c] = (nk - m).clamp(0, 255) as u8;
        }
    }
}

/// Whether the JPEG has an Adobe APP14 marker (scanned up to the first scan).
fn has_adobe_marker(bytes: &[u8]) -> bool {
    let mut i = 2;
    while i + 4 <= bytes.len() {
        if bytes[i] != 0xFF {
            return false;
        }
        let marker = bytes[i + 1];
        if marker == 0xFF {
            i += 1;
            continue;
        }
        if marker == 0xDA || marker == 0xD9 {
            return false;
        }
        let len = u16::from_be_bytes([bytes[i + 2], bytes[i + 3]]) as usize;
        if marker == 0xEE && bytes.get(i + 4..i + 9) == Some(b"Adobe") {
            return true;
        }
        i += 2 + len;
    }
    false
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
        assert!(d.decode(&bad, &h, 1, &mut out).is_err());
        let h = d.header(&good, u64::MAX).unwrap();
        d.decode(&good, &h, 1, &mut out).unwrap();
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
