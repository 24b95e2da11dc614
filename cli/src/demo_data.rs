//! The demo's dataset: a small ImageFolder generated on first run, so
//! `batchcast demo` decodes real JPEG and PNG files on a fresh machine with
//! nothing downloaded. Three classes with distinct, photo-like content
//! (smooth colour fields, shapes, grain), sizes from 240 to 900 pixels.

use std::path::PathBuf;

use batchcast::synthetic::SplitMix64;
use turbojpeg::{Compressor, Image, PixelFormat};

const CLASSES: [&str; 3] = ["discs", "stripes", "tiles"];
const PER_CLASS: usize = 120;
/// Bump when the generator changes, so stale folders are regenerated.
const VERSION: &str = "v1";

/// The demo dataset could not be written.
#[derive(Debug, thiserror::Error)]
#[error("generating the demo images: {what}: {why}")]
pub struct DemoDataError {
    what: String,
    why: String,
}

/// `.context(..)` for this module's errors: what was being done.
trait Doing<T> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, DemoDataError>;
}

impl<T, E: std::fmt::Display> Doing<T> for Result<T, E> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, DemoDataError> {
        self.map_err(|e| DemoDataError {
            what: what(),
            why: e.to_string(),
        })
    }
}

/// Returns the demo dataset's root, generating it if needed.
pub fn ensure() -> Result<PathBuf, DemoDataError> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let root = base
        .join("batchcast")
        .join(format!("demo-images-{VERSION}"));
    if root.join(".complete").exists() {
        return Ok(root);
    }
    println!(
        "generating the demo images in {} (first run only)",
        root.display()
    );
    let tmp = root.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    let mut jpeg = Compressor::new().doing(|| "starting the JPEG encoder".into())?;
    jpeg.set_quality(90)
        .doing(|| "setting the JPEG quality".into())?;
    let mut rng = SplitMix64::new(2026);
    for (c, class) in CLASSES.iter().enumerate() {
        let dir = tmp.join(class);
        std::fs::create_dir_all(&dir).doing(|| format!("creating {}", dir.display()))?;
        for i in 0..PER_CLASS {
            let w = 240 + rng.below(660) as usize;
            let h = 240 + rng.below(660) as usize;
            let px = picture(c, w, h, &mut rng);
            if i % 10 == 9 {
                let path = dir.join(format!("{i:04}.png"));
                write_png(&path, &px, w, h).doing(|| format!("writing {}", path.display()))?;
            } else {
                let img = Image {
                    pixels: &px[..],
                    width: w,
                    pitch: w * 3,
                    height: h,
                    format: PixelFormat::RGB,
                };
                let bytes = jpeg
                    .compress_to_vec(img)
                    .doing(|| "encoding a JPEG".into())?;
                let path = dir.join(format!("{i:04}.jpg"));
                std::fs::write(&path, bytes).doing(|| format!("writing {}", path.display()))?;
            }
        }
    }
    std::fs::write(tmp.join(".complete"), b"").doing(|| format!("writing {}", tmp.display()))?;
    let _ = std::fs::remove_dir_all(&root);
    std::fs::rename(&tmp, &root).doing(|| format!("moving into {}", root.display()))?;
    Ok(root)
}

fn unit(rng: &mut SplitMix64) -> f32 {
    (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32
}

/// RGB8 pixels of one picture of class `c`.
fn picture(c: usize, w: usize, h: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let base: Vec<f32> = (0..6).map(|_| unit(rng) * 255.0).collect();
    let (fx, fy, phase) = (
        unit(rng) * 0.05 + 0.005,
        unit(rng) * 0.05 + 0.005,
        unit(rng) * 6.0,
    );
    let (cx, cy, r) = (
        unit(rng) * w as f32,
        unit(rng) * h as f32,
        40.0 + unit(rng) * 200.0,
    );
    let mut px = vec![0u8; w * h * 3];
    let mut grain = SplitMix64::new(rng.next_u64());
    for y in 0..h {
        for x in 0..w {
            let (xf, yf) = (x as f32, y as f32);
            let t = match c {
                0 => (((xf - cx).powi(2) + (yf - cy).powi(2)).sqrt() / r).fract(),
                1 => 0.5 + 0.5 * (xf * fx + yf * fy * 0.3 + phase).sin(),
                _ => (((x / 48) + (y / 48)) % 2) as f32 * 0.8 + 0.1 * (yf * fy).sin(),
            };
            let n = (grain.next_u64() & 15) as f32 - 7.5;
            for k in 0..3 {
                let v = base[k] * t + base[k + 3] * (1.0 - t) + n;
                px[(y * w + x) * 3 + k] = v.clamp(0.0, 255.0) as u8;
            }
        }
    }
    px
}

fn write_png(
    path: &std::path::Path,
    px: &[u8],
    w: usize,
    h: usize,
) -> Result<(), png::EncodingError> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(file, w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(px)?;
    Ok(())
}
