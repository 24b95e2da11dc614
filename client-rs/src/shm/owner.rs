//! What only the broker does with shared memory: create and seal arenas,
//! send their fds (the `broker` feature, and this crate's tests).

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::ProtFlags;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

use super::{Fault, Mapping, shm_err};
use crate::error::{Error, Result};

/// A shared-memory arena owned by the broker: a sealed memfd and its
/// read-write mapping.
#[derive(Debug)]
pub struct Arena {
    fd: OwnedFd,
    /// Every region, mapped.
    map: Mapping,
    /// Bytes of one region.
    len: u64,
}

impl Arena {
    /// Creates an anonymous arena of `len` bytes, its memory allocated at
    /// once (`fallocate`: committed now, so a lack of memory is an error
    /// here, not a fault later), sealed against shrinking and growing, and
    /// mapped; `fault` says whether the mapping's pages are faulted in now.
    /// Allocating takes no lock of the process's memory map, so other
    /// threads go on meanwhile.
    pub fn create(name: &str, len: u64, fault: Fault) -> Result<Arena> {
        Arena::create_regions(name, len, 1, fault)
    }

    /// [`Arena::create`] of `regions` regions of `len` bytes each, the
    /// first allocated now and the others only by
    /// [`Arena::allocate_region`] (until then they cost address space in
    /// the mappings, no memory).
    pub fn create_regions(name: &str, len: u64, regions: u32, fault: Fault) -> Result<Arena> {
        let arena = Arena::reserve(name, len, regions, fault)?;
        arena.allocate_region(0)?;
        Ok(arena)
    }

    /// [`Arena::create_regions`] with no region allocated yet, not even
    /// the first: memory kept for a need that may never come costs only
    /// address space until [`Arena::allocate_region`] commits it (then a
    /// lack of memory is that call's error). A page read before reads
    /// zeros; nothing may be written to a region before it is allocated.
    pub fn reserve(name: &str, len: u64, regions: u32, fault: Fault) -> Result<Arena> {
        let cname = std::ffi::CString::new(format!("batchcast:{name}"))
            .map_err(|_| Error::Shm(format!("stream name `{name}` contains a NUL byte")))?;
        let fd = memfd_create(
            cname.as_c_str(),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| shm_err("memfd_create failed", e))?;
        let total = len
            .checked_mul(u64::from(regions.max(1)))
            .and_then(|t| i64::try_from(t).ok())
            .ok_or_else(|| Error::Shm(format!("arena of {regions} x {len} bytes is too large")))?;
        nix::unistd::ftruncate(&fd, total)
            .map_err(|e| shm_err(&format!("sizing the arena to {total} bytes failed"), e))?;
        let arena_len = usize::try_from(total)
            .map_err(|_| Error::Shm("arena larger than the address space".into()))?;
        let map = Mapping::map(
            fd.as_fd(),
            arena_len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            fault.flags(),
        )?;
        let arena = Arena { fd, map, len };
        fcntl(
            &arena.fd,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
        )
        .map_err(|e| shm_err("sealing the arena's size failed", e))?;
        Ok(arena)
    }

    /// Allocates region `region`'s memory (committed: a lack of memory is
    /// an error here). Sealed memory cannot be given back before the fd
    /// closes: a region once allocated stays so.
    pub fn allocate_region(&self, region: u32) -> Result<()> {
        let at = u64::from(region)
            .checked_mul(self.len)
            .and_then(|a| i64::try_from(a).ok());
        let len = i64::try_from(self.len).ok();
        let (Some(at), Some(len)) = (at, len) else {
            return Err(Error::Shm(format!(
                "region {region} of the arena is out of range"
            )));
        };
        if len > 0 {
            nix::fcntl::fallocate(&self.fd, nix::fcntl::FallocateFlags::empty(), at, len).map_err(
                |e| {
                    shm_err(
                        &format!("allocating the arena's {len} bytes (region {region}) failed"),
                        e,
                    )
                },
            )?;
        }
        Ok(())
    }

    /// Bytes of one region.
    pub fn region_len(&self) -> u64 {
        self.len
    }

    /// Forbids every future writable mapping and `write(2)` of the memfd, in
    /// every process (`F_SEAL_FUTURE_WRITE`); the broker's own mapping stays
    /// writable. Call after every writer has mapped the arena.
    pub fn seal_writes(&self) -> Result<()> {
        fcntl(
            &self.fd,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_FUTURE_WRITE | SealFlag::F_SEAL_SEAL),
        )
        .map_err(|e| shm_err("sealing the arena against writers failed", e))?;
        Ok(())
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn mapping(&self) -> &Mapping {
        &self.map
    }
}

/// Sends `bytes` with `fd` attached (`SCM_RIGHTS`). Returns the bytes
/// written, which may be fewer than `bytes.len()` on a non-blocking socket;
/// the fd travels with the first byte.
pub fn send_with_fd(sock: RawFd, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<usize> {
    send_with_fds(sock, bytes, &[fd])
}

/// [`send_with_fd`] with several fds, which arrive in this order.
pub fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<usize> {
    let fds: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(
        sock,
        &[IoSlice::new(bytes)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)
}
