//! CMYK and YCCK JPEGs as PIL reads them: TurboJPEG decodes them to
//! CMYK, converted here to RGB.

/// PIL's CMYK → RGB: `R = 255 - K' - C'·(255 - K')/255` with primes the
/// CMYK values PIL holds. Adobe's JPEGs store inverted CMYK, which PIL
/// reads as `CMYK;I`, so its values are `255 - stored`.
pub(super) fn cmyk_to_rgb(cmyk: &[u8], rgb: &mut [u8], adobe_inverted: bool) {
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
pub(super) fn has_adobe_marker(bytes: &[u8]) -> bool {
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
