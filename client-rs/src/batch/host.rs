//! The host arena as a consumer maps it: the region of it the shared
//! stream's batches are in now, moved when the broker says so
//! ([`crate::proto::ServerMsg::Arena`]).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::schema::RingLayout;
use crate::shm::{Mapping, RingView};

/// The host arena: its fd, and every ring of the region the shared
/// stream's batches are in now, mirrored ([`Mapping::rings`]). A batch
/// keeps the region it was read from mapped (`Batch::map`), so moving
/// on never unmaps memory a batch still reads.
#[derive(Debug)]
pub(crate) struct HostArena {
    fd: OwnedFd,
    /// The arena's regions (the fd's size over one region's).
    regions: u32,
    now: Mutex<(u32, Arc<Mapping>)>,
}

impl HostArena {
    /// Maps region `region` of the arena `fd`, of `regions`, laid out as
    /// `rings`.
    pub(crate) fn open(
        fd: OwnedFd,
        rings: &RingLayout,
        (region, regions): (u32, u32),
    ) -> Result<HostArena> {
        let map = Self::map(&fd, rings, (region, regions))?;
        Ok(HostArena {
            fd,
            regions,
            now: Mutex::new((region, Arc::new(map))),
        })
    }

    fn map(fd: &OwnedFd, rings: &RingLayout, (region, regions): (u32, u32)) -> Result<Mapping> {
        if region >= regions {
            return Err(Error::Shm(format!(
                "the broker named region {region} of a host arena of {regions}"
            )));
        }
        Mapping::rings(
            std::os::fd::AsFd::as_fd(fd),
            &RingView::of_region(rings, region),
            false,
        )
    }

    /// The region batches are read from now, mapped.
    pub(crate) fn current(&self) -> Arc<Mapping> {
        self.now.lock().unwrap_or_else(|p| p.into_inner()).1.clone()
    }

    /// Batches handed out from now on are read in region `region`
    /// ([`crate::proto::ServerMsg::Arena`]); those handed out before keep theirs.
    pub(crate) fn move_to(&self, rings: &RingLayout, region: u32) -> Result<()> {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if now.0 != region {
            let map = Self::map(&self.fd, rings, (region, self.regions))?;
            *now = (region, Arc::new(map));
        }
        Ok(())
    }
}
