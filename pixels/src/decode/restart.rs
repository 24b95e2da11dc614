//! Cutting a rectangle of MCUs out of a JPEG without entropy-decoding the
//! rest, where its scan has restart markers.
//!
//! A baseline JPEG's scan is one Huffman bit stream: nothing in it says
//! where an MCU starts, so even a decode of a small region must decode the
//! codes of every MCU before the region's last (libjpeg-turbo's cropping
//! region skips the inverse DCT of the others, not their Huffman codes).
//! A restart marker ends a byte-aligned segment of `interval` MCUs and
//! resets the DC predictions: each segment decodes on its own. Where the
//! segments line up with the MCU grid (the interval divides an MCU row, or
//! is whole MCU rows), the segments covering a rectangle, their markers
//! renumbered, form the scan of a smaller JPEG with the same tables: its
//! MCUs are the original's coefficients, so its pixels are the
//! original's, away from its edges (chroma upsampling blends across MCU
//! edges; the caller keeps a margin). `pixels/tests/crop_decode.rs` pins it.
//!
//! The bytes are untrusted: every offset is checked, and anything this
//! module does not recognise (progressive or arithmetic coding, several
//! scans, a segment count that does not add up) answers `None`, and the
//! caller decodes the usual way. Safe Rust throughout.

/// Where a JPEG's pieces lie, for [`Splicer::cut`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    /// Offset of the frame header's height (then its width), 2 bytes each.
    dims_at: usize,
    /// The scan's first entropy-coded byte (all before it is copied).
    scan_at: usize,
    width: usize,
    height: usize,
    /// MCU size in pixels.
    mcu: (usize, usize),
    /// MCUs per row and rows of MCUs.
    grid: (usize, usize),
    /// MCUs per restart interval.
    interval: usize,
}

/// A rectangle of MCUs: columns `c0..c1`, rows `r0..r1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct McuRect {
    c0: usize,
    c1: usize,
    r0: usize,
    r1: usize,
}

/// What [`Splicer::cut`] made: a JPEG of `width × height` pixels whose
/// top-left pixel is the original's `(x, y)` (full size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cut {
    pub x: usize,
    pub y: usize,
    pub width: usize,
    pub height: usize,
}

/// What [`Splicer::cut`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cutting {
    /// `jpeg` holds the cut.
    Cut(Cut),
    /// No cut: no restart markers that line up, a JPEG this module does
    /// not read, or a cut that would be the whole image. Decode as usual.
    No,
    /// Restart markers that line up, in a scan whose structure is broken
    /// (see `find_segments`): decode the whole image, whose decode then
    /// gives the file's verdict, as it would with no crop at all.
    Damaged,
}

/// Reusable buffers: one per decoder.
#[derive(Debug, Default)]
pub(super) struct Splicer {
    /// Each segment's entropy-coded bytes: `(start, end)` in the JPEG.
    segments: Vec<(usize, usize)>,
    /// The segments a cut writes, in order.
    order: Vec<usize>,
    /// The JPEG cut last.
    pub jpeg: Vec<u8>,
}

impl Splicer {
    /// Cuts the MCUs holding `want` (full-size pixels; widened to whole
    /// restart segments) out of `bytes` into `self.jpeg` (see [`Cutting`]).
    pub fn cut(&mut self, bytes: &[u8], want: Cut) -> Cutting {
        let Some(l) = layout(bytes) else {
            return Cutting::No;
        };
        let Some(r) = self.segments_for(&l, want) else {
            return Cutting::No;
        };
        let Some(&last) = self.order.last() else {
            return Cutting::No;
        };
        if self.find_segments(bytes, &l, last).is_none() {
            return Cutting::Damaged;
        }
        match self.splice(bytes, &l, r) {
            Some(c) => Cutting::Cut(c),
            None => Cutting::No,
        }
    }

    /// The MCUs a cut of `want` writes (whole restart segments), with the
    /// segments in `self.order`; `None` where there is no cut to make.
    fn segments_for(&mut self, l: &Layout, want: Cut) -> Option<McuRect> {
        let (cols, rows) = l.grid;
        let k = l.interval;
        let want = McuRect {
            c0: want.x / l.mcu.0,
            c1: (want.x + want.width).div_ceil(l.mcu.0),
            r0: want.y / l.mcu.1,
            r1: (want.y + want.height).div_ceil(l.mcu.1),
        };
        let (mut r, rows_per) = (want, k / cols);
        (r.c1, r.r1) = (r.c1.min(cols), r.r1.min(rows));
        if cols.is_multiple_of(k) {
            (r.c0, r.c1) = (r.c0 / k * k, r.c1.div_ceil(k) * k);
        } else if k.is_multiple_of(cols) {
            (r.c0, r.c1) = (0, cols);
            r.r0 = r.r0 / rows_per * rows_per;
            r.r1 = (r.r1.div_ceil(rows_per) * rows_per).min(rows);
        } else {
            return None;
        }
        if r.c0 >= r.c1 || r.r0 >= r.r1 || (r.c0, r.c1, r.r0, r.r1) == (0, cols, 0, rows) {
            return None;
        }
        // The segments to write, in order: a run of them per MCU row, or
        // one run of whole-row segments.
        self.order.clear();
        match r.r0.checked_div(rows_per) {
            None => {
                for row in r.r0..r.r1 {
                    let run = (row * cols + r.c0) / k..(row * cols + r.c1) / k;
                    self.order.extend(run);
                }
            }
            Some(first) => self.order.extend(first..r.r1.div_ceil(rows_per)),
        }
        Some(r)
    }

    /// Writes the JPEG of the MCUs `r` (their segments in `self.order`,
    /// found) into `self.jpeg`.
    fn splice(&mut self, bytes: &[u8], l: &Layout, r: McuRect) -> Option<Cut> {
        let cut = Cut {
            x: r.c0 * l.mcu.0,
            y: r.r0 * l.mcu.1,
            width: (r.c1 * l.mcu.0).min(l.width) - r.c0 * l.mcu.0,
            height: (r.r1 * l.mcu.1).min(l.height) - r.r0 * l.mcu.1,
        };
        let h = u16::try_from(cut.height).ok()?.to_be_bytes();
        let w = u16::try_from(cut.width).ok()?.to_be_bytes();
        let out = &mut self.jpeg;
        out.clear();
        out.extend_from_slice(&bytes[..l.scan_at]);
        out[l.dims_at..l.dims_at + 4].copy_from_slice(&[h[0], h[1], w[0], w[1]]);
        for (n, &i) in self.order.iter().enumerate() {
            let (s, e) = self.segments[i];
            if n > 0 {
                out.extend_from_slice(&[0xFF, 0xD0 + ((n - 1) % 8) as u8]);
            }
            out.extend_from_slice(&bytes[s..e]);
        }
        out.extend_from_slice(&[0xFF, 0xD9]);
        Some(cut)
    }

    /// Records the entropy-coded bytes of every segment of the scan, after
    /// checking the scan's whole structure (a cut reads only some of it, so
    /// damage elsewhere must be seen here, as the whole decode would): each
    /// segment ends at the restart marker the sequence expects (RST0,
    /// RST1, ... RST7, RST0...), there are as many as the frame's MCU grid
    /// implies, and the last ends at the image's EOI. `None` otherwise: the
    /// caller decodes as it would without markers, and fails where that
    /// fails. (Damage inside a segment's Huffman codes is not structure:
    /// a cut sees only that of its own segments.) `last`, the highest
    /// segment the cut writes, must be one of them.
    fn find_segments(&mut self, bytes: &[u8], l: &Layout, last: usize) -> Option<()> {
        let total = (l.grid.0 * l.grid.1).div_ceil(l.interval);
        if last >= total {
            return None;
        }
        self.segments.clear();
        self.segments.reserve(total);
        let (mut start, mut at) = (l.scan_at, l.scan_at);
        while self.segments.len() < total {
            let ff = at + memchr::memchr(0xFF, bytes.get(at..)?)?;
            // Fill bytes (0xFF runs) may precede a marker.
            let mut m = ff + 1;
            while *bytes.get(m)? == 0xFF {
                m += 1;
            }
            match bytes[m] {
                0x00 if m == ff + 1 => at = m + 1,
                code @ 0xD0..=0xD7 => {
                    let expect = (self.segments.len() % 8) as u8;
                    if code - 0xD0 != expect || self.segments.len() + 1 >= total {
                        return None;
                    }
                    self.segments.push((start, ff));
                    (start, at) = (m + 1, m + 1);
                }
                // The image's end: it ends the last segment.
                0xD9 if self.segments.len() + 1 == total => self.segments.push((start, ff)),
                // A marker the scan may not hold, or an end too early.
                _ => return None,
            }
        }
        Some(())
    }
}

/// Reads the markers up to the scan: a baseline or extended sequential
/// Huffman frame, one scan holding every component, a restart interval.
fn layout(bytes: &[u8]) -> Option<Layout> {
    let be16 = |at: usize| -> Option<usize> {
        Some(usize::from(u16::from_be_bytes([
            *bytes.get(at)?,
            *bytes.get(at + 1)?,
        ])))
    };
    if bytes.get(..2)? != [0xFF, 0xD8] {
        return None;
    }
    let (mut at, mut interval, mut frame) = (2, 0, None);
    loop {
        if *bytes.get(at)? != 0xFF {
            return None;
        }
        let code = *bytes.get(at + 1)?;
        if code == 0xFF {
            at += 1; // a fill byte
            continue;
        }
        let len = be16(at + 2)?;
        let body = at + 4;
        if len < 2 || bytes.len() < at + 2 + len {
            return None;
        }
        match code {
            // Baseline and extended sequential, Huffman-coded.
            0xC0 | 0xC1 => frame = Some(frame_of(bytes.get(body..at + 2 + len)?, body)?),
            // Any other frame: progressive, lossless, arithmetic, ...
            0xC2 | 0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => return None,
            0xDD => interval = be16(body)?,
            0xDA => {
                let f = frame?;
                let scan_components = usize::from(*bytes.get(body)?);
                if interval == 0 || scan_components != f.components {
                    return None;
                }
                return Some(Layout {
                    scan_at: at + 2 + len,
                    interval,
                    ..f.layout
                });
            }
            0xD8 | 0xD9 | 0xD0..=0xD7 | 0x01 => return None,
            _ => {}
        }
        at += 2 + len;
    }
}

struct Frame {
    layout: Layout,
    components: usize,
}

/// A frame header's body (from its precision byte), at `body` in the file.
fn frame_of(f: &[u8], body: usize) -> Option<Frame> {
    let height = usize::from(u16::from_be_bytes([*f.get(1)?, *f.get(2)?]));
    let width = usize::from(u16::from_be_bytes([*f.get(3)?, *f.get(4)?]));
    let components = usize::from(*f.get(5)?);
    if height == 0 || width == 0 || components == 0 || *f.first()? != 8 {
        return None;
    }
    let (mut hmax, mut vmax) = (1, 1);
    for c in 0..components {
        let s = *f.get(6 + 3 * c + 1)?;
        let (h, v) = (usize::from(s >> 4), usize::from(s & 15));
        if !(1..=4).contains(&h) || !(1..=4).contains(&v) {
            return None;
        }
        (hmax, vmax) = (hmax.max(h), vmax.max(v));
    }
    // One component is coded block by block whatever its sampling.
    let mcu = if components == 1 {
        (8, 8)
    } else {
        (8 * hmax, 8 * vmax)
    };
    Some(Frame {
        layout: Layout {
            dims_at: body + 1,
            scan_at: 0,
            width,
            height,
            mcu,
            grid: (width.div_ceil(mcu.0), height.div_ceil(mcu.1)),
            interval: 0,
        },
        components,
    })
}

#[cfg(test)]
mod tests {
    use batchcast_core::synthetic::SplitMix64;
    use turbojpeg::{Compressor, Image, PixelFormat, Subsamp};

    use super::super::tj::with_restarts;
    use super::super::{Decoder, Rgb};
    use super::*;

    /// A noisy 4:2:0 q90 JPEG of `w × h`.
    fn jpeg(w: usize, h: usize) -> Vec<u8> {
        let mut rng = SplitMix64::new((w * h) as u64);
        let px: Vec<u8> = (0..w * h * 3)
            .map(|i| ((i % (w * 3)) as u64 / 3 + rng.next_u64() % 64) as u8)
            .collect();
        let mut c = Compressor::new().unwrap();
        c.set_quality(90).unwrap();
        c.set_subsamp(Subsamp::Sub2x2).unwrap();
        let img = Image {
            pixels: &px[..],
            width: w,
            pitch: w * 3,
            height: h,
            format: PixelFormat::RGB,
        };
        c.compress_to_vec(img).unwrap()
    }

    fn decode(d: &mut Decoder, bytes: &[u8]) -> Rgb {
        let h = d.header(bytes, u64::MAX).unwrap();
        let mut out = Rgb::default();
        d.decode(bytes, &h, (1, None), &mut out).unwrap();
        out
    }

    #[test]
    fn a_cut_is_the_images_pixels_at_every_interval_that_lines_up() {
        let mut d = Decoder::new().unwrap();
        let mut s = Splicer::default();
        // 333 × 251: 21 MCUs a row, 16 rows; 320 × 240: 20 a row, 15 rows.
        for ((w, h), k, lines_up) in [
            ((333, 251), 1, true),
            ((320, 240), 4, true),
            ((333, 251), 3, true),
            ((333, 251), 21, true),
            ((320, 240), 40, true),
            ((333, 251), 5, false),
            ((320, 240), 30, false),
        ] {
            let original = jpeg(w, h);
            let whole = decode(&mut d, &original);
            let marked = with_restarts(&original, k).unwrap();
            let want = Cut {
                x: 70,
                y: 90,
                width: 100,
                height: 60,
            };
            let Cutting::Cut(cut) = s.cut(&marked, want) else {
                assert!(!lines_up, "{w}x{h} every {k}: no cut");
                continue;
            };
            assert!(lines_up, "{w}x{h} every {k}: cut {cut:?}");
            assert!(cut.x <= want.x && cut.y <= want.y, "{cut:?}");
            assert!(cut.x + cut.width >= want.x + want.width, "{cut:?}");
            assert!(cut.y + cut.height >= want.y + want.height, "{cut:?}");
            let part = decode(&mut d, &s.jpeg);
            assert_eq!(
                (part.width, part.height),
                (cut.width as u32, cut.height as u32)
            );
            // Away from the cut's edges inside the image (where chroma
            // upsampling lacks a neighbour), every pixel is the image's.
            let inner = |at: usize, len: usize, full: usize| {
                let from = if at == 0 { 0 } else { 2 };
                let to = if at + len == full { len } else { len - 2 };
                from..to
            };
            for y in inner(cut.y, cut.height, h) {
                let xs = inner(cut.x, cut.width, w);
                let a = ((cut.y + y) * w + cut.x + xs.start) * 3;
                let b = (y * cut.width + xs.start) * 3;
                let n = xs.len() * 3;
                assert!(
                    whole.data[a..a + n] == part.data[b..b + n],
                    "{w}x{h} every {k}: row {y} of {cut:?}"
                );
            }
        }
    }

    #[test]
    fn a_cut_covering_the_image_or_a_broken_sequence_is_not_made() {
        let mut s = Splicer::default();
        let marked = with_restarts(&jpeg(320, 240), 1).unwrap();
        let all = Cut {
            x: 0,
            y: 0,
            width: 320,
            height: 240,
        };
        assert_eq!(s.cut(&marked, all), Cutting::No);
        let some = Cut {
            x: 64,
            y: 64,
            width: 32,
            height: 32,
        };
        assert!(matches!(s.cut(&marked, some), Cutting::Cut(_)));
        // A marker out of sequence: RST3 where RST2 belongs.
        let mut bad = marked.clone();
        let third = (0..bad.len() - 1)
            .find(|&i| bad[i] == 0xFF && bad[i + 1] == 0xD2)
            .unwrap();
        bad[third + 1] = 0xD3;
        assert_eq!(s.cut(&bad, some), Cutting::Damaged);
        // No restart markers at all.
        assert_eq!(s.cut(&jpeg(320, 240), some), Cutting::No);
    }

    #[test]
    fn broken_files_never_panic_the_cut_or_the_decode() {
        // Cut short anywhere, or bytes overwritten: a cut or none, and a
        // decode that succeeds or fails, never a panic or a write outside
        // the buffer.
        let marked = with_restarts(&jpeg(333, 251), 1).unwrap();
        let mut d = Decoder::new().unwrap();
        let mut s = Splicer::default();
        let mut rng = SplitMix64::new(11);
        let region = super::super::Region {
            x: 40,
            y: 50,
            width: 90,
            height: 70,
        };
        let mut out = Rgb::default();
        let want = Cut {
            x: 40,
            y: 50,
            width: 90,
            height: 70,
        };
        for i in 0..400 {
            let mut b = marked.clone();
            if i % 2 == 0 {
                b.truncate(rng.below(b.len() as u64) as usize);
            } else {
                for _ in 0..1 + i % 5 {
                    let at = rng.below(b.len() as u64) as usize;
                    b[at] = rng.next_u64() as u8;
                }
            }
            let _ = s.cut(&b, want);
            if let Ok(h) = d.header(&b, u64::MAX) {
                let _ = d.decode(&b, &h, (1, Some(region)), &mut out);
            }
        }
    }

    /// `marked` damaged in the ways a file's structure can be: cut
    /// short, its EOI gone, restart markers out of sequence, missing or
    /// added, a marker the scan may not hold, a frame header that lies
    /// about the image's size or a restart interval that does not match
    /// the scan. Named, for a failure's message.
    fn damaged(marked: &[u8]) -> Vec<(String, Vec<u8>)> {
        let markers: Vec<usize> = (0..marked.len() - 1)
            .filter(|&i| marked[i] == 0xFF && (0xD0..=0xD7).contains(&marked[i + 1]))
            .collect();
        let sof = (0..marked.len() - 1)
            .find(|&i| marked[i] == 0xFF && marked[i + 1] == 0xC0)
            .unwrap();
        let dri = (0..marked.len() - 1)
            .find(|&i| marked[i] == 0xFF && marked[i + 1] == 0xDD)
            .unwrap();
        let scan = markers[0];
        let n = marked.len();
        let mut out = Vec::new();
        for pct in [1, 25, 50, 75, 99] {
            let at = scan + (n - 2 - scan) * pct / 100;
            out.push((
                format!("cut short at {pct} % of its scan"),
                marked[..at].to_vec(),
            ));
        }
        out.push(("without its EOI".into(), marked[..n - 2].to_vec()));
        let mut b = marked.to_vec();
        b[n - 1] = 0xD8;
        out.push(("an SOI where its EOI was".into(), b));
        for pct in [5, 50, 95] {
            let m = markers[markers.len() * pct / 100];
            let mut b = marked.to_vec();
            b[m + 1] = 0xD0 + (b[m + 1] - 0xD0 + 3) % 8;
            out.push((format!("a marker out of sequence at {pct} %"), b));
            let mut b = marked.to_vec();
            b.drain(m..m + 2);
            out.push((format!("a marker missing at {pct} %"), b));
            let mut b = marked.to_vec();
            b.splice(m..m, [0xFF, b[m + 1]]);
            out.push((format!("a marker twice at {pct} %"), b));
            let mut b = marked.to_vec();
            b.splice(m..m, [0xFF, 0xC4]);
            out.push((format!("a DHT marker inside the scan at {pct} %"), b));
        }
        for (what, at, delta) in [
            ("height", sof + 5, 16i32),
            ("height", sof + 5, -16),
            ("width", sof + 7, 16),
            ("width", sof + 7, -16),
        ] {
            let mut b = marked.to_vec();
            let v = i32::from(u16::from_be_bytes([b[at], b[at + 1]])) + delta;
            b[at..at + 2].copy_from_slice(&(v as u16).to_be_bytes());
            out.push((format!("a frame header whose {what} is {delta:+} off"), b));
        }
        let mut b = marked.to_vec();
        b[dri + 5] = 2;
        out.push(("a restart interval of 2 over segments of 1".into(), b));
        out
    }

    #[test]
    fn a_damaged_file_is_bad_to_the_cut_exactly_when_it_is_bad_to_the_whole_decode() {
        let mut d = Decoder::new().unwrap();
        let mut out = Rgb::default();
        let (mut cut, mut bad) = (0, 0);
        for (w, h) in [(333, 251), (320, 240)] {
            let marked = with_restarts(&jpeg(w, h), 1).unwrap();
            let mut corpus = vec![("intact".to_string(), marked.clone())];
            corpus.extend(damaged(&marked));
            for (name, b) in corpus {
                let whole = d
                    .header(&b, u64::MAX)
                    .and_then(|hd| d.decode(&b, &hd, (1, None), &mut out));
                bad += usize::from(whole.is_err());
                for (rx, ry) in [(0, 0), (1, 1), (2, 2), (0, 2), (2, 0), (1, 0)] {
                    let region = super::super::Region {
                        x: (rx * w / 3) as u32,
                        y: (ry * h / 3) as u32,
                        width: (w / 4) as u32,
                        height: (h / 4) as u32,
                    };
                    let part = d
                        .header(&b, u64::MAX)
                        .and_then(|hd| d.decode(&b, &hd, (1, Some(region)), &mut out));
                    assert_eq!(
                        part.is_ok(),
                        whole.is_ok(),
                        "{w}x{h}, {name}: the whole decode {whole:?}, the crop at {region:?} {part:?}"
                    );
                    cut += usize::from(part.is_ok() && out.cut);
                }
            }
        }
        // The intact files were cut at every region; most damaged ones
        // are bad to both.
        assert!(cut >= 12, "{cut} crops cut");
        assert!(bad >= 30, "{bad} files bad to the whole decode");
    }
}
