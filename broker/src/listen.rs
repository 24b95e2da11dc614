//! The broker's Unix socket: where it lives, who may use it, and what
//! happens when a socket file is already there.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("a broker is already serving on {0}; stop it first or pass another --socket")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it (pass another --socket)")]
    NotASocket(PathBuf),
    #[error(
        "{path} is a socket of uid {uid}, not of uid {me} (this broker): another user bound the path while no broker ran (its folder is shared, as a sticky /tmp is); the broker neither talks to nor removes it. Pass --socket in a folder only you can write (e.g. /run/user/{me}), or have uid {uid} or root remove it"
    )]
    OthersSocket { path: PathBuf, uid: u32, me: u32 },
    #[error(
        "refusing the socket folder {dir}: {problem}, so another user could replace the socket and impersonate the broker. Remove it (the broker then creates it owner-only), `chmod 700` it, or pass --socket in a folder only you can write"
    )]
    UnsafeDir { dir: PathBuf, problem: String },
    #[error("cannot prepare socket {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A bound listening socket that removes its file when dropped (if the file
/// is still the one it created; never one a service manager passed).
#[derive(Debug)]
pub struct Bound {
    pub listener: UnixListener,
    pub path: PathBuf,
    /// The inode of the file this process created; `None` when the socket
    /// was inherited (its file is the service manager's).
    ino: Option<u64>,
}

impl Bound {
    /// A listening socket a service manager passed (socket activation):
    /// served as it is, its file left alone.
    pub fn inherited(listener: UnixListener, path: PathBuf) -> Bound {
        Bound {
            listener,
            path,
            ino: None,
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        let Some(ino) = self.ino else { return };
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds `path` with mode 0600 (0666 when `shared`, where peer credentials
/// decide who is admitted). A stale socket left by a dead broker is
/// replaced; a live broker's is refused.
pub fn bind(path: &Path, shared: bool) -> Result<Bound, ListenError> {
    let io = |source| ListenError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
        if let Some(warning) = check_dir(dir)? {
            tracing::warn!("{}: {warning}", path.display());
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(ListenError::NotASocket(path.into()));
        }
        Ok(meta) if meta.uid() != nix::unistd::geteuid().as_raw() => {
            return Err(ListenError::OthersSocket {
                path: path.into(),
                uid: meta.uid(),
                me: nix::unistd::geteuid().as_raw(),
            });
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(ListenError::InUse(path.into())),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                tracing::info!(
                    "replacing stale socket {} left by a broker that is gone",
                    path.display()
                );
                std::fs::remove_file(path).map_err(io)?;
            }
            Err(e) => return Err(io(e)),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    // Owner-only from the moment the file exists: no window in which another
    // user could connect.
    // umask is process-wide; it is changed only here, before the pipeline
    // threads and the async runtime start.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let listener = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = listener.map_err(io)?;
    if shared {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(io)?;
    }
    let ino = std::fs::symlink_metadata(path).map_err(io)?.ino();
    Ok(Bound {
        listener,
        path: path.into(),
        ino: Some(ino),
    })
}

/// A socket's folder must be one only this user (or root) controls: owned
/// by this user or root, not a link, and writable by nobody else unless
/// sticky (like `/tmp`, where others cannot remove or rename this user's
/// files). Otherwise another user could swap the socket for their own, as
/// ssh-agent and tmux also refuse. A sticky shared folder is allowed with
/// a warning (the answer's `Some`): while no broker runs, another user may
/// bind the path first (this broker then refuses to start, naming them,
/// and clients refuse a socket of another uid).
pub(crate) fn check_dir(dir: &Path) -> Result<Option<String>, ListenError> {
    let unsafe_dir = |problem: String| ListenError::UnsafeDir {
        dir: dir.into(),
        problem,
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|source| ListenError::Io {
        path: dir.into(),
        source,
    })?;
    if meta.file_type().is_symlink() {
        return Err(unsafe_dir("it is a symbolic link".into()));
    }
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a folder".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(unsafe_dir(format!(
            "it belongs to uid {}, not to uid {me} (this broker) or root",
            meta.uid()
        )));
    }
    let mode = meta.mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(unsafe_dir(format!(
            "others may write in it (mode {:o}) and it is not sticky",
            mode & 0o7777
        )));
    }
    if mode & 0o022 != 0 {
        let me = nix::unistd::geteuid().as_raw();
        return Ok(Some(format!(
            "its folder {} is shared (mode {:o}): while no broker runs, another user may bind this path first, and then this broker refuses to start (its trainers refuse a socket of another uid). Put the socket in a folder only you can write, e.g. --socket /run/user/{me}/batchcast.sock",
            dir.display(),
            mode & 0o7777
        )));
    }
    Ok(None)
}

/// Who may connect: the broker's own user, plus the config's allow lists.
#[derive(Debug, Clone)]
pub struct Allow {
    pub own_uid: u32,
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl Allow {
    pub fn is_shared(&self) -> bool {
        !self.uids.is_empty() || !self.gids.is_empty()
    }

    /// Whether a socket file of `mode` and group `gid` (one a service
    /// manager made) keeps out users the allow lists admit: `None` when
    /// others may open it, or it is a group socket of an allowed group and
    /// no uid is allowed beyond that group; else what to change.
    pub fn unreachable(&self, mode: u32, gid: u32) -> Option<String> {
        if !self.is_shared() || mode & 0o006 == 0o006 {
            return None;
        }
        let group_socket = mode & 0o060 == 0o060 && self.gids.contains(&gid);
        if group_socket && self.uids.is_empty() {
            return None;
        }
        Some(format!(
            "has mode {:o} and group {gid}: only {} can open it. Make the .socket unit's SocketGroup= a group in allow_groups (or allow_gids) with SocketMode=0660 and add the trainers' users to it{}, or set SocketMode=0666 (peer credentials still decide who is admitted)",
            mode & 0o777,
            if mode & 0o060 == 0o060 {
                "its owner and that group's members"
            } else {
                "its owner"
            },
            if self.uids.is_empty() {
                ""
            } else {
                " (allow_uids' users too)"
            },
        ))
    }

    /// Checks a peer's credentials (`SO_PEERCRED`); supplementary groups are
    /// read from `/proc/<pid>/status`.
    pub fn admits(&self, uid: u32, gid: u32, pid: Option<i32>) -> bool {
        if uid == self.own_uid || self.uids.contains(&uid) || self.gids.contains(&gid) {
            return true;
        }
        if self.gids.is_empty() {
            return false;
        }
        let Some(pid) = pid else { return false };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .is_some_and(|g| {
                g.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .any(|g: u32| self.gids.contains(&g))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_sockets_are_replaced_live_ones_refused_files_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.sock");
        let first = bind(&path, false).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(bind(&path, false), Err(ListenError::InUse(_))));
        // A dead broker leaves its socket file behind: simulate by leaking it.
        std::mem::forget(first);
        let again = bind(&path, false);
        assert!(
            matches!(again, Err(ListenError::InUse(_))),
            "the leaked listener still accepts"
        );
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            bind(&file, false),
            Err(ListenError::NotASocket(_))
        ));
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }

    /// In a sticky shared folder another user may bind the path while no
    /// broker runs: refused by name, never connected to or removed.
    #[test]
    fn another_users_socket_at_the_path_is_refused_by_name() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: chown to another uid needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.sock");
        let impostor = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        let err = bind(&path, false).unwrap_err();
        assert!(
            matches!(&err, ListenError::OthersSocket { uid: 65534, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("uid 65534") && err.to_string().contains("/run/user/"));
        assert!(path.exists(), "the other user's socket is left alone");
        drop(impostor);
    }

    /// A sticky shared folder (as /tmp) is allowed with a warning that
    /// names the squatting risk and where to go instead; a folder only
    /// this user writes gets none; a shared one that is not sticky is
    /// refused.
    #[test]
    fn a_sticky_shared_folder_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(check_dir(dir.path()).unwrap(), None);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let warning = check_dir(dir.path()).unwrap().expect("a warning");
        assert!(
            warning.contains("another user may bind this path first")
                && warning.contains("/run/user/"),
            "{warning}"
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            check_dir(dir.path()),
            Err(ListenError::UnsafeDir { .. })
        ));
    }

    #[test]
    fn a_socket_whose_broker_died_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap()); // file stays, nobody listens
        assert!(path.exists());
        let b = bind(&path, true).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o666
        );
        drop(b);
        assert!(!path.exists(), "socket file removed on drop");
    }

    #[test]
    fn allow_lists() {
        let a = Allow {
            own_uid: 1000,
            uids: vec![1001],
            gids: vec![50],
        };
        assert!(a.admits(1000, 1000, None));
        assert!(a.admits(1001, 1001, None));
        assert!(a.admits(1002, 50, None));
        assert!(!a.admits(1003, 1003, None));
        let own = Allow {
            own_uid: 1000,
            uids: vec![],
            gids: vec![],
        };
        assert!(!own.admits(0, 0, None));
    }

    /// The socket a service manager made reaches whom the config admits:
    /// a group socket of an allowed group does, an owner-only one does not.
    #[test]
    fn a_socket_units_mode_and_group_against_the_allow_lists() {
        let groups = Allow {
            own_uid: 1000,
            uids: vec![],
            gids: vec![50],
        };
        assert_eq!(groups.unreachable(0o140660, 50), None);
        assert_eq!(groups.unreachable(0o140666, 7), None);
        let owner_only = groups.unreachable(0o140600, 50).unwrap();
        assert!(owner_only.contains("mode 600") && owner_only.contains("only its owner can"));
        let other_group = groups.unreachable(0o140660, 7).unwrap();
        assert!(other_group.contains("SocketGroup=") && other_group.contains("group 7"));
        let uids = Allow {
            own_uid: 1000,
            uids: vec![1001],
            gids: vec![50],
        };
        assert!(
            uids.unreachable(0o140660, 50)
                .unwrap()
                .contains("allow_uids")
        );
        let alone = Allow {
            own_uid: 1000,
            uids: vec![],
            gids: vec![],
        };
        assert_eq!(alone.unreachable(0o140600, 50), None);
    }
}
