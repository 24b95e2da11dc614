//! A device ring mapped twice, back to back, with CUDA's virtual memory
//! management: the building block of device consumers with their own batch
//! size. A run of consecutive samples that straddles the ring's end is one
//! contiguous range in the second view, so a device batch of any size is
//! a plain tensor without a copy, as the host arena's mirrored rings are.
//!
//! The physical allocation (`cuMemCreate`, exportable as a POSIX fd) is
//! mapped at `base` and at `base + len` of one reservation of `2 * len`
//! bytes; its length is a multiple of the allocation granularity (2 MiB on
//! current GPUs). The broker creates it and sends the fd over its socket
//! (`SCM_RIGHTS`); a consumer imports it and maps it the same way, so both
//! see the same bytes at the same offsets.
//!
//! Driver calls (virtual memory management, which cudarc's own `result`
//! layer lacks) are in [`super::result`].

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaError, DeviceRange, Gpu, result};

/// The granularity every ring length is a multiple of on `gpu`.
pub fn granularity(gpu: &Arc<Gpu>) -> Result<usize, CudaError> {
    gpu.bind()?;
    Ok(result::granularity(&result::ring_properties(gpu.info.ordinal))?.max(1))
}

/// Device memory of `len` bytes mapped at `ptr` and again at `ptr + len`.
/// Reads and copies may use any range of `ptr .. ptr + 2 * len`; bytes at
/// `x` and `x + len` are the same.
#[derive(Debug)]
pub struct MirroredRing {
    /// The whole reservation (`2 * len` bytes).
    range: DeviceRange,
    ring_len: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

impl std::ops::Deref for MirroredRing {
    type Target = DeviceRange;
    fn deref(&self) -> &DeviceRange {
        &self.range
    }
}

impl MirroredRing {
    /// A new ring of at least `min_len` bytes (rounded up to the
    /// granularity) on `gpu`.
    pub fn create(gpu: &Arc<Gpu>, min_len: usize) -> Result<MirroredRing, CudaError> {
        let g = granularity(gpu)?;
        let len = min_len
            .max(1)
            .checked_next_multiple_of(g)
            .ok_or_else(|| too_large(min_len))?;
        gpu.bind()?;
        let handle = result::mem_create(len, &result::ring_properties(gpu.info.ordinal))?;
        MirroredRing::map(gpu, handle, len, g)
    }

    /// Imports the ring another process exported as `fd`; `len` is its
    /// length as that process reported it (checked against the driver's
    /// granularity here, and against the allocation by the driver).
    pub fn import(
        gpu: &Arc<Gpu>,
        fd: BorrowedFd<'_>,
        len: usize,
    ) -> Result<MirroredRing, CudaError> {
        let g = granularity(gpu)?;
        if len == 0 || !len.is_multiple_of(g) {
            return Err(CudaError::BadRing {
                len,
                granularity: g,
            });
        }
        gpu.bind()?;
        let handle = result::mem_import(fd)?;
        MirroredRing::map(gpu, handle, len, g)
    }

    /// Reserves `2 * len` bytes of address space and maps `handle` into
    /// both halves, readable and writable by `gpu`. Releases `handle` (and
    /// whatever it mapped) if any step fails.
    fn map(
        gpu: &Arc<Gpu>,
        handle: sys::CUmemGenericAllocationHandle,
        len: usize,
        align: usize,
    ) -> Result<MirroredRing, CudaError> {
        let mut ring = MirroredRing {
            range: DeviceRange {
                gpu: gpu.clone(),
                ptr: 0,
                len: 0,
            },
            ring_len: len,
            handle,
        };
        let total = len.checked_mul(2).ok_or_else(|| too_large(len))?;
        let ptr = result::address_reserve(total, align)?;
        ring.range.ptr = ptr;
        for half in [ptr, ptr + len as u64] {
            // SAFETY: `half .. half + len` lies inside our own reservation
            // and is not mapped yet; the allocation holds `len` bytes.
            unsafe { result::mem_map(half, len, handle) }?;
            // Counted as mapped from here on, so drop unmaps it.
            ring.range.len += len;
        }
        // SAFETY: the whole reservation is mapped (above).
        unsafe { result::mem_set_access(ptr, total, gpu.info.ordinal) }?;
        Ok(ring)
    }

    /// Bytes of the ring (each of its two views).
    pub fn ring_len(&self) -> usize {
        self.ring_len
    }

    /// The allocation as a file descriptor another process imports with
    /// [`MirroredRing::import`] (sent over a Unix socket).
    pub fn export(&self) -> Result<OwnedFd, CudaError> {
        self.range.gpu.bind()?;
        // SAFETY: the handle lives as long as `self`; it was made
        // exportable as a POSIX fd (`result::ring_properties`).
        unsafe { result::mem_export(self.handle) }
    }
}

fn too_large(len: usize) -> CudaError {
    CudaError::BadRing {
        len,
        granularity: 0,
    }
}

impl Drop for MirroredRing {
    fn drop(&mut self) {
        if self.range.gpu.bind().is_err() {
            return;
        }
        let ptr = self.range.ptr;
        // SAFETY: unmaps exactly the views `map` mapped (`range.len` counts
        // them), frees the reservation it made, then releases the handle;
        // each once. Batches that point into the ring hold it alive.
        unsafe {
            if self.range.len > 0 {
                let _ = result::mem_unmap(ptr, self.range.len);
            }
            if ptr != 0 {
                let _ = result::address_free(ptr, 2 * self.ring_len);
            }
            let _ = result::mem_release(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd, FromRawFd};

    const FD_VAR: &str = "BATCHCAST_TEST_RING_FD";
    const LEN_VAR: &str = "BATCHCAST_TEST_RING_LEN";

    /// 3000 bytes that differ from any shift of themselves.
    fn pattern(salt: u8) -> Vec<u8> {
        (0..3000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ salt)
            .collect()
    }

    #[test]
    #[ignore = "needs a GPU (bench/gpu.sh runs it)"]
    fn gpu_a_mirrored_ring_is_contiguous_across_its_end_in_another_process() {
        if std::env::var_os(FD_VAR).is_some() {
            return; // the child half runs below
        }
        let gpu = Gpu::open(0).expect("cuda:0");
        let ring = MirroredRing::create(&gpu, 1000).expect("create");
        let len = ring.ring_len();
        assert!(len >= 1000 && len.is_multiple_of(granularity(&gpu).unwrap()));
        assert_eq!(ring.len(), 2 * len);
        // Written through the second view across the end...
        let p = pattern(0);
        ring.write(len - 1000, &p).expect("write across the end");
        // ...lands at the end of the first view and at its start.
        let mut tail = vec![0u8; 1000];
        ring.read(len - 1000, &mut tail).unwrap();
        assert_eq!(tail, p[..1000]);
        let mut head = vec![0u8; 2000];
        ring.read(0, &mut head).unwrap();
        assert_eq!(head, p[1000..]);
        // Another process imports the fd, reads the same bytes across the
        // end, and writes its own through its second view.
        let fd = ring.export().expect("export");
        let inherited = nix::unistd::dup(fd.as_fd()).expect("dup");
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cuda::ring::tests::gpu_child_imports_the_ring",
                "--include-ignored",
                "--nocapture",
            ])
            .env(FD_VAR, inherited.as_raw_fd().to_string())
            .env(LEN_VAR, len.to_string())
            .status()
            .expect("child");
        assert!(status.success(), "the importing process failed");
        let mut back = vec![0u8; 3000];
        ring.read(len - 1000, &mut back).unwrap();
        assert_eq!(back, pattern(0x5a), "the child's writes are not seen");
    }

    #[test]
    #[ignore = "needs a GPU (the child half of the test above)"]
    fn gpu_child_imports_the_ring() {
        let (Ok(fd), Ok(len)) = (std::env::var(FD_VAR), std::env::var(LEN_VAR)) else {
            return;
        };
        let (fd, len): (i32, usize) = (fd.parse().unwrap(), len.parse().unwrap());
        // SAFETY: the parent passed this descriptor to us, open, for this use.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let gpu = Gpu::open(0).expect("cuda:0");
        let ring = MirroredRing::import(&gpu, fd.as_fd(), len).expect("import");
        let mut seen = vec![0u8; 3000];
        ring.read(len - 1000, &mut seen).unwrap();
        assert_eq!(seen, pattern(0));
        let mut second = vec![0u8; 2000];
        ring.read(len, &mut second).unwrap();
        assert_eq!(second, pattern(0)[1000..], "second view at its start");
        ring.write(len - 1000, &pattern(0x5a)).unwrap();
        assert!(matches!(
            MirroredRing::import(&gpu, fd.as_fd(), len + 1),
            Err(CudaError::BadRing { .. })
        ));
    }
}
