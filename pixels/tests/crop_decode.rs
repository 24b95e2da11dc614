//! Decoding in part gives the whole decode's bytes: the decoder's pixels
//! in every region asked for, and RandomResizedCrop's tensors, across the
//! samplings TurboJPEG crops, progressive and baseline, CMYK, odd sizes
//! and every reduced scale; and the same for the JPEGs re-encoded with a
//! restart marker after every MCU, which a decode in part cuts instead.

use turbojpeg::{Colorspace, Compressor, Image, PixelFormat, Subsamp};

use batchcast_core::synthetic::SplitMix64;
use batchcast_pixels::decode::{Decoder, Region, Rgb, restart_marked};
use batchcast_pixels::transform::{Geometry, Interpolation, Lut, Scratch, Transform};

/// A photo-like image: smooth colour fields under fine texture and edges
/// (what chroma upsampling and the resampling filters blend).
fn picture(w: usize, h: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut px = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let (fx, fy) = (x as f64, y as f64);
            let noise = (rng.next_u64() % 48) as f64;
            let edge = if (x / 37 + y / 23) % 2 == 0 {
                60.0
            } else {
                0.0
            };
            for c in 0..3 {
                let wave = ((fx * (0.03 + 0.02 * c as f64) + fy * 0.05).sin() + 1.0) * 70.0;
                px.push((wave + noise + edge).min(255.0) as u8);
            }
        }
    }
    px
}

/// `picture` encoded at q90 with `subsamp` (CMYK: four channels).
fn jpeg(w: usize, h: usize, subsamp: Subsamp, progressive: bool, cmyk: bool) -> Vec<u8> {
    let rgb = picture(w, h, (w * h) as u64 ^ subsamp as u64);
    let mut c = Compressor::new().unwrap();
    c.set_quality(90).unwrap();
    c.set_subsamp(subsamp).unwrap();
    c.set_progressive(progressive).unwrap();
    if cmyk {
        let px: Vec<u8> = rgb
            .chunks_exact(3)
            .flat_map(|p| [p[0], p[1], p[2], 255 - p[0].max(p[1]).max(p[2])])
            .collect();
        c.set_colorspace(Colorspace::YCCK).unwrap();
        let img = Image {
            pixels: &px[..],
            width: w,
            pitch: w * 4,
            height: h,
            format: PixelFormat::CMYK,
        };
        return c.compress_to_vec(img).unwrap();
    }
    let img = Image {
        pixels: &rgb[..],
        width: w,
        pitch: w * 3,
        height: h,
        format: PixelFormat::RGB,
    };
    c.compress_to_vec(img).unwrap()
}

/// Every encoding exercised: (name, bytes).
fn encodings() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (subsamp, name) in [
        (Subsamp::None, "444"),
        (Subsamp::Sub2x1, "422"),
        (Subsamp::Sub2x2, "420"),
        (Subsamp::Gray, "gray"),
        (Subsamp::Sub1x2, "440"),
        (Subsamp::Sub4x1, "411"),
    ] {
        for progressive in [false, true] {
            let (w, h) = if progressive { (517, 389) } else { (333, 251) };
            out.push((
                format!("{name} {w}x{h} progressive={progressive}"),
                jpeg(w, h, subsamp, progressive, false),
            ));
        }
    }
    out.push((
        "CMYK 420 301x203".into(),
        jpeg(301, 203, Subsamp::Sub2x2, false, true),
    ));
    out
}

fn whole(d: &mut Decoder, bytes: &[u8], denom: u32) -> Rgb {
    let h = d.header(bytes, u64::MAX).unwrap();
    let mut out = Rgb::default();
    d.decode(bytes, &h, (denom, None), &mut out).unwrap();
    assert_eq!(out.decoded, None);
    out
}

#[test]
fn decoded_regions_are_the_whole_decodes_pixels() {
    decoded_regions_match(false);
}

#[test]
fn restart_marked_jpegs_decode_to_the_same_pixels_whole_and_in_part() {
    decoded_regions_match(true);
}

/// Random regions of every encoding at every scale against the whole
/// decode of the JPEG as encoded; `marked`: the regions decoded from it
/// re-encoded with restart markers (which must decode whole to the same
/// pixels too).
fn decoded_regions_match(marked: bool) {
    let mut d = Decoder::new().unwrap();
    let mut rng = SplitMix64::new(7);
    // One buffer for all: stale pixels of earlier images stay outside
    // each region, as in a pipeline thread.
    let mut part = Rgb::default();
    for (name, original) in encodings() {
        let bytes = match marked {
            true => restart_marked(&original, 1).unwrap(),
            false => original.clone(),
        };
        let header = d.header(&bytes, u64::MAX).unwrap();
        for denom in [1, 2, 4, 8] {
            let full = whole(&mut d, &original, denom);
            if marked {
                let again = whole(&mut d, &bytes, denom);
                assert!(again.data == full.data, "{name} re-encoded, 1/{denom}");
            }
            let (w, h) = (full.width, full.height);
            // Random regions, then small ones whose edges fall at every
            // offset within an MCU (where a cut's edge would show).
            for i in 0..36u32 {
                let r = if i < 12 {
                    let x = rng.below(w as u64) as u32;
                    let y = rng.below(h as u64) as u32;
                    Region {
                        x,
                        y,
                        width: 1 + rng.below(u64::from(w - x)) as u32,
                        height: 1 + rng.below(u64::from(h - y)) as u32,
                    }
                } else {
                    let (x, y) = ((i * 7) % w, (i * 5) % h);
                    Region {
                        x,
                        y,
                        width: (1 + i % 5).min(w - x),
                        height: (1 + i % 4).min(h - y),
                    }
                };
                d.decode(&bytes, &header, (denom, Some(r)), &mut part)
                    .unwrap();
                assert_eq!((part.width, part.height), (w, h), "{name}");
                assert!(
                    part.has(&r),
                    "{name} 1/{denom}: {r:?} not in {:?}",
                    part.decoded
                );
                for row in r.y..r.y + r.height {
                    let at = (row as usize * w as usize + r.x as usize) * 3;
                    let n = r.width as usize * 3;
                    assert!(
                        part.data[at..at + n] == full.data[at..at + n],
                        "{name} at 1/{denom}: row {row} of {r:?} differs from the whole decode"
                    );
                }
            }
        }
    }
}

#[test]
fn a_region_decode_touches_less_than_the_image() {
    // A small region of a large image is decoded in part, its left edge
    // on an iMCU boundary, one iMCU around it.
    let bytes = jpeg(640, 480, Subsamp::Sub2x2, false, false);
    let mut d = Decoder::new().unwrap();
    let h = d.header(&bytes, u64::MAX).unwrap();
    let mut out = Rgb::default();
    let r = Region {
        x: 100,
        y: 200,
        width: 50,
        height: 40,
    };
    d.decode(&bytes, &h, (1, Some(r)), &mut out).unwrap();
    let got = out.decoded.expect("decoded in part");
    assert_eq!(
        got,
        Region {
            x: 80,
            y: 184,
            width: 86,
            height: 72,
        }
    );
    // A region covering the image is a whole decode.
    let all = Region {
        x: 0,
        y: 0,
        width: 640,
        height: 480,
    };
    d.decode(&bytes, &h, (1, Some(all)), &mut out).unwrap();
    assert_eq!(out.decoded, None);
    // With restart markers, the MCUs around it are cut out: whole MCU
    // rows and columns (16 × 16 here) holding it and 4 pixels around it,
    // decoded as a JPEG of their own.
    let marked = restart_marked(&bytes, 1).unwrap();
    d.decode(&marked, &h, (1, Some(r)), &mut out).unwrap();
    assert_eq!(
        out.decoded,
        Some(Region {
            x: 96,
            y: 192,
            width: 64,
            height: 64,
        })
    );
    let quarter = Region {
        x: 25,
        y: 50,
        width: 13,
        height: 10,
    };
    d.decode(&marked, &h, (4, Some(quarter)), &mut out).unwrap();
    assert_eq!(
        out.decoded,
        Some(Region {
            x: 20,
            y: 44,
            width: 24,
            height: 20,
        })
    );
}

#[test]
fn random_resized_crops_of_a_decode_in_part_are_byte_identical() {
    let mut d = Decoder::new().unwrap();
    let mut scratch = Scratch::default();
    let encoded = [
        jpeg(1203, 907, Subsamp::Sub2x2, false, false),
        jpeg(905, 1211, Subsamp::Sub2x1, true, false),
    ];
    // Each as encoded, then re-encoded with restart markers (cut, not
    // cropped by TurboJPEG), against the whole decode as encoded.
    let marked = encoded.iter().map(|b| restart_marked(b, 1).unwrap());
    let pairs: Vec<(&Vec<u8>, Vec<u8>)> = encoded
        .iter()
        .zip(encoded.iter().cloned())
        .chain(encoded.iter().zip(marked))
        .collect();
    for interpolation in [
        Interpolation::Bilinear,
        Interpolation::Bicubic,
        Interpolation::Lanczos,
        Interpolation::Hamming,
        Interpolation::Box,
        Interpolation::Nearest,
    ] {
        let t = Transform {
            interpolation,
            flip_p: 0.5,
            ..Transform::of(Geometry::RandomResizedCrop {
                size: (64, 48),
                scale: (0.08, 1.0),
                ratio: (3.0 / 4.0, 4.0 / 3.0),
            })
        };
        let lut = Lut::new(&t);
        let n = 64 * 48 * 3 * 4;
        let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
        let mut part = Rgb::default();
        for (original, bytes) in &pairs {
            let header = d.header(bytes, u64::MAX).unwrap();
            let (w, h) = (header.width, header.height);
            for index in 0..40 {
                let plan = t.plan(w, h, &mut t.rng(0, index));
                let denom = t.reduction(&plan, w, h);
                let region = t.decode_region(&plan, w, h, denom);
                assert!(region.is_some());
                let full = whole(&mut d, original, denom);
                t.apply(&full, &plan, denom, &lut, &mut scratch, &mut a)
                    .unwrap();
                d.decode(bytes, &header, (denom, region), &mut part)
                    .unwrap();
                // Poison all but the region the transform says it reads
                // (inside what was decoded): the resize must not read there.
                poison_outside(&mut part, region.unwrap());
                t.apply(&part, &plan, denom, &lut, &mut scratch, &mut b)
                    .unwrap();
                assert!(
                    a == b,
                    "{interpolation:?}, {w}x{h} sample {index} at 1/{denom}: {:?} differs",
                    plan.crop
                );
            }
        }
    }
}

/// Writes a loud pattern everywhere outside `r`: a resize that read there
/// would not match the whole decode's bytes.
fn poison_outside(img: &mut Rgb, r: Region) {
    let w = img.width as usize;
    for (i, px) in img.data.chunks_exact_mut(3).enumerate() {
        let (x, y) = ((i % w) as u32, (i / w) as u32);
        let inside = x >= r.x && x < r.x + r.width && y >= r.y && y < r.y + r.height;
        if !inside {
            px.copy_from_slice(&[255, 0, (i % 251) as u8]);
        }
    }
}
