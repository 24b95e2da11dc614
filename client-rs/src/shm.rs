//! Shared memory and file-descriptor passing. With [`mailbox`](crate::mailbox)
//! (futexes) and `cuda` (driver calls), one of the three modules of the
//! client library with `unsafe` code; a layout in shared memory is viewed
//! only through [`Mapping::view`], for the core's [`Shared`] types.
//!
//! * [`Arena::create`] (broker side) makes an anonymous `memfd`, sizes it,
//!   maps it read-write and seals it: it can never shrink or grow (so no
//!   client can make the broker fault), and after [`Arena::seal_writes`] no
//!   new writable mapping can be made by anyone, so consumers cannot write
//!   into what other consumers read, even deliberately.
//! * [`Mapping::map_readonly`] (client side) maps a received arena fd
//!   `PROT_READ`. An in-place write through a view faults in the offending
//!   process instead of reaching the others.
//! * The memfd has no name in any filesystem: when the last process holding
//!   it exits, however it exits, the memory is gone. Nothing is left in
//!   `/dev/shm`.
//! * [`send_with_fd`] / [`recv_with_fds`] move the fd over the Unix socket
//!   with `SCM_RIGHTS`.

use std::ffi::c_void;
use std::io::IoSliceMut;
use std::num::NonZeroUsize;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use nix::sys::mman::{MapFlags, ProtFlags, mmap, mmap_anonymous, munmap};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};

use batchcast_core::shared::Shared;

use crate::error::{Error, Result};

#[cfg(any(test, feature = "broker"))]
mod owner;
#[cfg(any(test, feature = "broker"))]
pub use owner::{Arena, send_with_fd, send_with_fds};

fn shm_err(what: &str, e: nix::Error) -> Error {
    Error::Shm(format!("{what}: {e}"))
}

/// The system's page size.
fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |p| p as u64)
}

/// One ring of an arena to map with [`Mapping::rings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingView {
    /// Offset in the fd (page-aligned).
    pub offset: u64,
    /// Bytes (whole pages).
    pub len: u64,
    /// Map it twice, back to back.
    pub mirrored: bool,
}

impl RingView {
    /// The views of every ring of `layout`, in order.
    pub fn of(layout: &crate::schema::RingLayout) -> Vec<RingView> {
        RingView::of_region(layout, 0)
    }

    /// The views of every ring of `layout` in region `region` of the
    /// arena ([`RingLayout::region_bytes`](crate::schema::RingLayout::region_bytes)).
    pub fn of_region(layout: &crate::schema::RingLayout, region: u32) -> Vec<RingView> {
        let base = u64::from(region) * layout.region_bytes();
        layout
            .fields
            .iter()
            .map(|r| RingView {
                offset: base + r.offset,
                len: r.ring_bytes,
                mirrored: r.mirrored,
            })
            .collect()
    }
}

/// A memory mapping of (part of) a memfd, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; all
// access goes through `&self` (reads) or the `unsafe` `slice_mut`, whose
// caller guarantees exclusivity.
unsafe impl Send for Mapping {}
// SAFETY: as above; concurrent `&[u8]` reads of shared memory are fine.
unsafe impl Sync for Mapping {}

/// The address space every view of `rings` takes (a mirrored ring twice),
/// once each ring is checked: page-aligned, non-empty, inside the fd.
fn rings_length(fd: BorrowedFd<'_>, rings: &[RingView]) -> Result<NonZeroUsize> {
    let page = page_size();
    let size = nix::sys::stat::fstat(fd)
        .map_err(|e| shm_err("fstat of the arena fd failed", e))?
        .st_size as u64;
    let mut total = 0u64;
    for r in rings {
        if r.len == 0 || !r.offset.is_multiple_of(page) || !r.len.is_multiple_of(page) {
            return Err(Error::Shm(format!(
                "a ring needs a page-aligned offset and length (page {page}): got {} + {}",
                r.offset, r.len
            )));
        }
        let end = r.offset.saturating_add(r.len);
        if end > size {
            return Err(Error::Shm(format!(
                "ring {}..{end} outside the arena fd of {size} bytes",
                r.offset
            )));
        }
        let views = if r.mirrored { 2 } else { 1 };
        total = r
            .len
            .checked_mul(views)
            .and_then(|b| total.checked_add(b))
            .ok_or_else(|| Error::Shm("rings larger than the address space".into()))?;
    }
    usize::try_from(total)
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| Error::Shm("no ring to map, or rings too large".into()))
}

impl Mapping {
    fn map(fd: BorrowedFd<'_>, len: usize, prot: ProtFlags, extra: MapFlags) -> Result<Mapping> {
        let nz =
            NonZeroUsize::new(len).ok_or_else(|| Error::Shm("cannot map an empty arena".into()))?;
        // SAFETY: we map a fresh region chosen by the kernel (addr = None), so
        // no existing Rust object is aliased; the fd is a valid memfd of at
        // least `len` bytes (callers check its size first), so the pages are
        // backed and cannot be truncated away (the arena is sealed against
        // shrinking).
        let ptr = unsafe { mmap(None, nz, prot, MapFlags::MAP_SHARED | extra, fd, 0) }
            .map_err(|e| shm_err("mmap of the arena failed", e))?;
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            writable: prot.contains(ProtFlags::PROT_WRITE),
        })
    }

    /// Maps a whole arena fd read-only, checking its size is at least `min_len`.
    pub fn map_readonly(fd: BorrowedFd<'_>, min_len: u64) -> Result<Mapping> {
        Mapping::map_whole(fd, min_len, ProtFlags::PROT_READ)
    }

    /// Maps a whole arena fd read-write (an external producer, before the
    /// broker seals the arena), checking its size is at least `min_len`.
    pub fn map_readwrite(fd: BorrowedFd<'_>, min_len: u64) -> Result<Mapping> {
        Mapping::map_whole(fd, min_len, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE)
    }

    fn map_whole(fd: BorrowedFd<'_>, min_len: u64, prot: ProtFlags) -> Result<Mapping> {
        let size = nix::sys::stat::fstat(fd)
            .map_err(|e| shm_err("fstat of the arena fd failed", e))?
            .st_size as u64;
        if size < min_len {
            return Err(Error::Shm(format!(
                "arena fd holds {size} bytes but the layout needs {min_len}"
            )));
        }
        let len = usize::try_from(size)
            .map_err(|_| Error::Shm("arena larger than the address space".into()))?;
        Mapping::map(fd, len, prot, MapFlags::empty())
    }

    /// Maps `ring_len` bytes of `fd` starting at `offset` twice, back to
    /// back: byte `i` of the ring is at `i` and at `ring_len + i`, the same
    /// physical page. Any window of up to `ring_len` bytes that starts in
    /// the ring is then one contiguous slice, across the wrap, without a
    /// copy: the basis for a consumer's batches of any size over a ring of
    /// samples. `offset` and `ring_len` must be multiples of the page size,
    /// and `offset + ring_len` within the fd (checked).
    pub fn mirrored(
        fd: BorrowedFd<'_>,
        offset: u64,
        ring_len: u64,
        writable: bool,
    ) -> Result<Mapping> {
        Mapping::rings(
            fd,
            &[RingView {
                offset,
                len: ring_len,
                mirrored: true,
            }],
            writable,
        )
    }

    /// Maps the rings of an arena one after another in one range of
    /// address space, each mirrored ([`Mapping::mirrored`]) or once: ring
    /// `k` starts where ring `k − 1`'s views end. Offsets and lengths must
    /// be multiples of the page size and lie within the fd (checked).
    pub fn rings(fd: BorrowedFd<'_>, rings: &[RingView], writable: bool) -> Result<Mapping> {
        Mapping::rings_faulted(fd, rings, writable, Fault::from_writable(writable))
    }

    /// [`Mapping::rings`], saying when the views' pages are faulted in: a
    /// writer that fills every page soon wants [`Fault::Now`]; a mapping
    /// made while the process serves others (a replay arena, a producer's
    /// arena the broker only reads) wants [`Fault::Lazily`], since
    /// populating holds the process's memory map lock for as long as it
    /// takes and stalls every other thread that maps or unmaps.
    pub fn rings_faulted(
        fd: BorrowedFd<'_>,
        rings: &[RingView],
        writable: bool,
        fault: Fault,
    ) -> Result<Mapping> {
        let len = rings_length(fd, rings)?;
        let prot = if writable {
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
        } else {
            ProtFlags::PROT_READ
        };
        let populate = fault.flags();
        // SAFETY: a fresh anonymous reservation chosen by the kernel
        // (addr = None): no Rust object lives there. It only reserves the
        // address range for the views below.
        let base = unsafe {
            mmap_anonymous(
                None,
                len,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }
        .map_err(|e| shm_err("reserving address space for the arena's rings failed", e))?;
        // Owns the reservation from here: unmapped if a view fails.
        let reserved = Mapping {
            ptr: base.cast(),
            len: len.get(),
            writable,
        };
        let mut at_off = 0usize;
        for r in rings {
            let half = NonZeroUsize::new(r.len as usize).expect("checked non-zero");
            let file_off = libc::off_t::try_from(r.offset)
                .map_err(|_| Error::Shm("ring offset out of range".into()))?;
            for _ in 0..if r.mirrored { 2 } else { 1 } {
                // SAFETY: `at_off + half` is at most the reservation's
                // length (the sum of every view, computed above), so the
                // pointer stays inside it.
                let at = unsafe { base.cast::<u8>().add(at_off) };
                // SAFETY: `at .. at + half` lies inside our own reservation
                // above, which nothing else uses, so MAP_FIXED replaces only
                // it; the fd holds `offset + len` bytes (checked) and the
                // arena is sealed against shrinking.
                let view = unsafe {
                    mmap(
                        Some(NonZeroUsize::new(at.as_ptr() as usize).expect("non-null")),
                        half,
                        prot,
                        MapFlags::MAP_SHARED | MapFlags::MAP_FIXED | populate,
                        fd,
                        file_off,
                    )
                }
                .map_err(|e| shm_err("mapping a view of an arena's ring failed", e))?;
                debug_assert_eq!(view.as_ptr() as usize, at.as_ptr() as usize);
                at_off += half.get();
            }
        }
        Ok(reserved)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte (for zero-copy checks and DLPack).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The bytes at `offset..offset + len`, or `None` if out of bounds.
    pub fn get(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: `offset..end` lies inside the live mapping (checked above);
        // the mapping outlives the returned borrow of `self`. Other processes
        // write only slots the hub gave them exclusively, never a slot that a
        // reader was handed and has not released.
        Some(unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize)
        })
    }

    /// The [`Shared`] value at `offset`: the one place a layout is laid
    /// over a mapping (a mailbox's header).
    ///
    /// # Panics
    ///
    /// If it lies outside the mapping or `offset` is not aligned for `T`
    /// (a layout's offsets are fixed: a bug, not an input).
    #[inline]
    pub fn view<T: Shared>(&self, offset: usize) -> &T {
        &self.view_slice::<T>(offset, 1)[0]
    }

    /// `len` [`Shared`] values from `offset` on (a mailbox's rings).
    ///
    /// # Panics
    ///
    /// As [`view`](Self::view).
    #[inline]
    pub fn view_slice<T: Shared>(&self, offset: usize, len: usize) -> &[T] {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("view size overflows");
        assert!(
            offset.is_multiple_of(align_of::<T>())
                && offset.checked_add(bytes).is_some_and(|end| end <= self.len),
            "a view of {len} x {} bytes at {offset} in a mapping of {} bytes",
            size_of::<T>(),
            self.len
        );
        // SAFETY: in bounds and aligned for `T` (asserted; the mapping is
        // page-aligned, and `Shared` types are aligned to at most a page),
        // and live as long as the borrow of `self`. `Shared` says any bits
        // are a `T` and that every access to it, from either process, is
        // atomic, so the other side's writes are not data races.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset).cast::<T>(), len) }
    }

    /// Mutable bytes at `offset..offset + len` of a writable mapping.
    ///
    /// # Safety
    ///
    /// The caller must have exclusive use of this range for the lifetime of
    /// the returned slice: no other `slice_mut` or `get` of an overlapping
    /// range in this process, and no reader in any process (the broker's hub
    /// guarantees this for a slot in its `Filling` state).
    ///
    /// # Panics
    ///
    /// If the mapping is read-only or the range is out of bounds.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        assert!(self.writable, "slice_mut on a read-only mapping");
        let end = offset.checked_add(len).expect("range overflow");
        assert!(
            end <= self.len as u64,
            "range {offset}..{end} outside mapping of {}",
            self.len
        );
        // SAFETY: in bounds (asserted) and writable; exclusivity is the
        // caller's contract above.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len as usize)
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the region mmap returned, and
        // no borrow of it can outlive `self`.
        if let Err(e) = unsafe { munmap(self.ptr.cast::<c_void>(), self.len) } {
            tracing::warn!("munmap of the arena failed: {e}");
        }
    }
}

/// When a mapping's pages are faulted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// At once (`MAP_POPULATE`): for a writer about to fill every page,
    /// before it serves anyone.
    Now,
    /// On first touch: for mappings made while the process serves others.
    Lazily,
}

impl Fault {
    /// A writer faults in at once; a reader as it reads.
    pub fn from_writable(writable: bool) -> Fault {
        if writable { Fault::Now } else { Fault::Lazily }
    }

    fn flags(self) -> MapFlags {
        match self {
            Fault::Now => MapFlags::MAP_POPULATE,
            Fault::Lazily => MapFlags::empty(),
        }
    }
}

/// Receives into `buf`, returning the bytes read and any fds that arrived
/// with them (close-on-exec). `Ok((0, _))` means end of stream.
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(sock, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(std::io::Error::from)?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in our table for this
                // message; nothing else owns it, so taking ownership is sound.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    let n = msg.bytes;
    if truncated {
        return Err(std::io::Error::other(
            "control message truncated: too many fds sent",
        ));
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd};

    #[test]
    fn a_mirrored_ring_is_one_contiguous_window_across_its_wrap() {
        let page = page_size();
        // A header page, then a ring of two pages.
        let arena = Arena::create("ring", 3 * page, Fault::Now).unwrap();
        let writer = Mapping::mirrored(arena.fd(), page, 2 * page, true).unwrap();
        let reader = Mapping::mirrored(arena.fd(), page, 2 * page, false).unwrap();
        assert_eq!(writer.len() as u64, 4 * page);
        // Write the ring's last 8 bytes and first 8 through the first view.
        let end = 2 * page - 8;
        // SAFETY: this test is the mapping's only user.
        unsafe { writer.slice_mut(end, 8) }.copy_from_slice(b"ABCDEFGH");
        // SAFETY: as above.
        unsafe { writer.slice_mut(0, 8) }.copy_from_slice(b"12345678");
        // One window across the wrap, in the other process's view too.
        assert_eq!(reader.get(end, 16).unwrap(), b"ABCDEFGH12345678");
        // The same bytes as the arena's own mapping at the ring's offset.
        assert_eq!(arena.mapping().get(page, 8).unwrap(), b"12345678");
        // Unaligned or out-of-range rings are refused.
        assert!(Mapping::mirrored(arena.fd(), 1, page, false).is_err());
        assert!(Mapping::mirrored(arena.fd(), page, 3 * page, false).is_err());
        // A read-only view of a sealed arena still maps.
        arena.seal_writes().unwrap();
        let sealed = Mapping::mirrored(arena.fd(), page, 2 * page, false).unwrap();
        assert_eq!(sealed.get(end, 16).unwrap(), b"ABCDEFGH12345678");
    }
    use std::os::unix::net::UnixStream;

    #[test]
    fn arena_passes_over_a_socket_and_maps_read_only() {
        let arena = Arena::create("test", 3 * 4096, Fault::Lazily).unwrap();
        // SAFETY: test owns the arena and nothing reads it concurrently.
        unsafe { arena.mapping().slice_mut(4096, 4) }.copy_from_slice(b"abcd");
        arena.seal_writes().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(send_with_fd(a.as_raw_fd(), b"x", arena.fd()).unwrap(), 1);
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (1, 1));
        let map = Mapping::map_readonly(fds[0].as_fd(), 3 * 4096).unwrap();
        assert_eq!(map.get(4096, 4).unwrap(), b"abcd");
        assert!(map.get(3 * 4096 - 2, 4).is_none());
        // The broker's earlier writable mapping still writes; the reader sees it.
        // SAFETY: as above.
        (unsafe { arena.mapping().slice_mut(4096, 1) })[0] = b'z';
        assert_eq!(map.get(4096, 1).unwrap(), b"z");
        assert!(Mapping::map_readonly(fds[0].as_fd(), 4 * 4096).is_err());
    }

    #[test]
    fn sealed_arena_refuses_new_writable_mappings_and_resizing() {
        let arena = Arena::create("seal", 4096, Fault::Now).unwrap();
        arena.seal_writes().unwrap();
        let w = Mapping::map(
            arena.fd(),
            4096,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::empty(),
        );
        assert!(w.is_err(), "a writable mapping of a sealed arena must fail");
        assert!(nix::unistd::ftruncate(arena.fd(), 0).is_err());
        assert!(nix::unistd::ftruncate(arena.fd(), 8192).is_err());
    }
}
