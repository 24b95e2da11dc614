//! The sweep file `batchcast launch` reads, and its expansion into one
//! plan per trainer process. Everything that can be wrong with the file is
//! found here, before any process starts.
//!
//! ```toml
//! [launch]
//! config = "imagefolder.toml"   # the broker's streams; or [[stream]] tables here
//! stream = "train"              # what trainers subscribe to (default: the only stream)
//! on_failure = "continue"       # or "stop-all"
//! run_dir = "runs"              # each launch writes a new folder in it
//!                               # (default: ./batchcast-runs)
//! # socket = "/run/batchcast.sock"  # use this running broker instead of starting one
//! # gpus = [0, 1]               # GPUs to spread trainers over (default: all visible)
//!
//! [[trainer]]
//! name = "lr"
//! command = ["python", "train.py", "--lr", "{lr}"]
//! grid = { lr = [0.1, 0.01, 0.001] }  # one copy per combination (× copies)
//! copies = 1
//! env = { SEED = "{index}" }
//! gpu = "round-robin"           # or "none", an index, or a list of indices
//! cwd = "."
//! baseline_command = ["python", "train.py", "--loader", "dataloader", "--lr", "{lr}"]
//! # batch_size = "{bs}"       # its own batch size ($BATCHCAST_BATCH_SIZE); a grid
//!                             # key `batch_size` sets it too: grid = { batch_size = [64, 128, 256] }
//! # join = "now"              # how it joins ($BATCHCAST_JOIN): "next-epoch", "immediate",
//!                             # or "now" (a complete first epoch at once, replayed)
//! ```
//!
//! Relative paths are relative to the sweep file's folder. Placeholders in
//! `command`, `baseline_command` and `env` values: `{name}`, `{index}`,
//! `{gpu}`, `{batchcast}` (this executable) and the grid's keys; `{{` is a
//! literal brace.

use batchcast::options::env_var;
use std::path::{Path, PathBuf};

use super::expand::{expand_trainers, gpu_value};
pub use super::file::{Host, TrainerPlan};
use super::file::{LaunchSection, SweepFile, ordinal};
pub use batchcast_cli::report::OnFailure;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read sweep file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sweep file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// Where the broker's streams come from.
#[derive(Debug, Clone)]
pub enum BrokerSource {
    /// Start a broker with this config text; relative paths in it resolve
    /// from `dir` (the broker runs there).
    Start { config: String, dir: PathBuf },
    /// Use the broker already serving this socket.
    Reuse(PathBuf),
}

/// A whole sweep, checked and expanded.
#[derive(Debug, Clone)]
pub struct Sweep {
    pub path: PathBuf,
    pub broker: BrokerSource,
    pub trainers: Vec<TrainerPlan>,
    pub on_failure: OnFailure,
    pub run_dir: PathBuf,
    pub grace_s: f64,
    /// Times a broker the run started is started again when it dies
    /// (its trainers ride through); 0: never.
    pub broker_restarts: u32,
}

/// The `[launch]` section's numbers, checked.
fn check_numbers(l: &LaunchSection) -> Result<(), String> {
    if let Some(g) = l.grace_s
        && !(g.is_finite() && g >= 0.0)
    {
        return Err(format!(
            "[launch] grace_s = {g} must be a number of seconds ≥ 0"
        ));
    }
    if let Some(n) = l.broker_restarts
        && n > 100
    {
        return Err(format!(
            "[launch] broker_restarts = {n}: at most 100 (a broker that dies that often needs its log read, not another start)"
        ));
    }
    if l.broker_restarts.is_some() && l.socket.is_some() {
        return Err("[launch] broker_restarts applies to a broker the run starts; with socket = … the broker is someone else's to restart (its trainers ride through when they do)".into());
    }
    Ok(())
}

/// Times a broker the run started is started again, unless the sweep says.
pub const BROKER_RESTARTS: u32 = 3;

impl Sweep {
    pub fn load(path: &Path, host: &Host) -> Result<Sweep, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
            path: path.into(),
            source,
        })?;
        Sweep::parse(&text, path, host)
    }

    /// Parses and checks a sweep file (`path` locates relative paths and
    /// names the file in errors).
    pub fn parse(text: &str, path: &Path, host: &Host) -> Result<Sweep, SpecError> {
        let invalid = |message: String| SpecError::Invalid {
            path: path.into(),
            message,
        };
        let file: SweepFile = toml::from_str(text).map_err(|e| {
            invalid(super::file::misplaced_launch_key(text).unwrap_or_else(|| e.to_string()))
        })?;
        let dir = path
            .parent()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                }
            })
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let l = &file.launch;
        if file.trainers.is_empty() {
            return Err(invalid(
                "no [[trainer]] defined; add one with a `name` and a `command`".into(),
            ));
        }
        if l.config.is_none() && l.socket.is_none() {
            check_inline(&file, &dir).map_err(invalid)?;
        }
        let (broker, config_tables) = broker_source(&file, &dir).map_err(invalid)?;
        let mut streams = Vec::new();
        if let Some(t) = &config_tables {
            streams = stream_names(t).map_err(invalid)?;
        }
        let default_stream = match (&l.stream, streams.as_slice()) {
            (Some(s), _) => s.clone(),
            (None, [only]) => only.clone(),
            (None, _) => "train".to_string(),
        };
        check_numbers(l).map_err(invalid)?;
        let gpus: Vec<String> = match &l.gpus {
            None => host.gpus.clone(),
            Some(list) => list
                .iter()
                .map(|&i| gpu_value(host, i, "[launch] gpus"))
                .collect::<Result<_, _>>()
                .map_err(|e| invalid(e.to_string()))?,
        };

        let trainers = expand_trainers(&file, host, &gpus, &default_stream, &dir, &streams)
            .map_err(|e| invalid(e.to_string()))?;
        let broker = match (broker, config_tables) {
            (BrokerSource::Start { dir, .. }, Some(mut table)) => {
                set_min_consumers(&mut table, &trainers);
                set_max_batch_size(&mut table, &trainers);
                BrokerSource::Start {
                    config: toml::to_string(&table)
                        .map_err(|e| invalid(format!("cannot write the broker config: {e}")))?,
                    dir,
                }
            }
            (b, _) => b,
        };
        Ok(Sweep {
            path: path.into(),
            broker,
            trainers,
            on_failure: l.on_failure,
            run_dir: l
                .run_dir
                .as_ref()
                .map_or_else(|| PathBuf::from("batchcast-runs"), |d| dir.join(d)),
            grace_s: l.grace_s.unwrap_or(10.0),
            broker_restarts: l.broker_restarts.unwrap_or(BROKER_RESTARTS),
        })
    }

    /// The broker config for a private broker serving one trainer
    /// (`--baseline`): the same streams, each waiting for one consumer.
    pub fn private_config(&self) -> Option<(String, PathBuf)> {
        let BrokerSource::Start { config, dir } = &self.broker else {
            return None;
        };
        let mut table: toml::Table = toml::from_str(config).ok()?;
        if let Some(toml::Value::Array(streams)) = table.get_mut("stream") {
            for s in streams {
                if let Some(t) = s.as_table_mut() {
                    t.insert("min_consumers".into(), toml::Value::Integer(1));
                }
            }
        }
        table.remove("broker");
        Some((toml::to_string(&table).ok()?, dir.clone()))
    }
}

/// The sweep file's own `[broker]` and `[[stream]]` tables checked as the
/// broker will read them, before a run folder or a broker exists: an
/// unknown key or a bad value names the table in this file (not a line of
/// the config the run writes), and so does an image folder that is not
/// there (relative paths are the sweep file's folder's).
fn check_inline(file: &SweepFile, dir: &Path) -> Result<(), String> {
    use batchcast_broker::config::{BrokerSection, StreamConfig};
    if let Some(b) = &file.broker {
        toml::Value::Table(b.clone())
            .try_into::<BrokerSection>()
            .map_err(|e| format!("[broker]: {}", e.message()))?;
    }
    for (i, t) in file.streams.iter().enumerate() {
        let name = t.get("name").and_then(|n| n.as_str()).map_or_else(
            || format!("the {} [[stream]]", ordinal(i)),
            |n| format!("[[stream]] `{n}`"),
        );
        toml::Value::Table(t.clone())
            .try_into::<StreamConfig>()
            .map_err(|e| format!("{name}: {}", e.message()))?;
        let root = t
            .get("image_folder")
            .and_then(|f| f.get("root"))
            .and_then(|r| r.as_str());
        if let Some(root) = root.filter(|r| !r.contains("://")) {
            let at = match root.strip_prefix("~/") {
                Some(rest) => std::env::var_os("HOME")
                    .map_or_else(|| dir.join(root), |h| PathBuf::from(h).join(rest)),
                None => dir.join(root),
            };
            if !at.is_dir() {
                return Err(format!(
                    "{name}: its image_folder root {root:?} is not a folder ({} does not exist or is not one); relative paths are this file's folder's",
                    at.display()
                ));
            }
        }
    }
    Ok(())
}

fn stream_names(table: &toml::Table) -> Result<Vec<String>, String> {
    let Some(streams) = table.get("stream") else {
        return Err("the broker config defines no [[stream]]".into());
    };
    let arr = streams
        .as_array()
        .ok_or("`stream` must be an array of tables ([[stream]])")?;
    arr.iter()
        .enumerate()
        .map(|(i, s)| {
            s.get("name")
                .and_then(|n| n.as_str())
                .map(str::to_string)
                .ok_or_else(|| format!("the {} [[stream]] has no `name`", ordinal(i)))
        })
        .collect()
}

/// Streams wait for every trainer subscribed to them, unless the file
/// says otherwise: a sweep's trainers start together, and one that joined
/// late would miss the first epoch.
/// Sizes each stream's ring for the largest batch size its trainers ask
/// (`max_batch_size`, raised to theirs where the config gives less), so a
/// grid over batch sizes needs no hand-computed `slots`.
fn set_max_batch_size(table: &mut toml::Table, trainers: &[TrainerPlan]) {
    let Some(toml::Value::Array(streams)) = table.get_mut("stream") else {
        return;
    };
    for s in streams {
        let Some(t) = s.as_table_mut() else { continue };
        let name = t.get("name").and_then(|n| n.as_str()).unwrap_or_default();
        let asked = trainers
            .iter()
            .filter(|p| p.stream == name)
            .filter_map(|p| {
                p.env
                    .iter()
                    .find(|(k, _)| k == env_var("batch_size"))
                    .and_then(|(_, v)| v.parse::<i64>().ok())
            })
            .max();
        let given = t.get("max_batch_size").and_then(toml::Value::as_integer);
        if let Some(asked) = asked
            && given.is_none_or(|g| g < asked)
        {
            t.insert("max_batch_size".into(), toml::Value::Integer(asked));
        }
    }
}

fn set_min_consumers(table: &mut toml::Table, trainers: &[TrainerPlan]) {
    let Some(toml::Value::Array(streams)) = table.get_mut("stream") else {
        return;
    };
    for s in streams {
        let Some(t) = s.as_table_mut() else { continue };
        let name = t.get("name").and_then(|n| n.as_str()).unwrap_or_default();
        let n = trainers.iter().filter(|p| p.stream == name).count();
        if n > 0 && !t.contains_key("min_consumers") {
            t.insert("min_consumers".into(), toml::Value::Integer(n as i64));
        }
    }
}

/// Which broker the sweep uses, and (to start one) its config as a table.
fn broker_source(
    file: &SweepFile,
    dir: &Path,
) -> Result<(BrokerSource, Option<toml::Table>), String> {
    let l = &file.launch;
    Ok(match (&l.socket, &l.config) {
        (Some(_), Some(_)) => {
            return Err(
                "[launch] has both `socket` (use a running broker) and `config` (start one); keep one"
                    .into(),
            );
        }
        (Some(_), None) if !file.streams.is_empty() => {
            return Err(
                "[launch] socket = … uses a running broker, so the [[stream]] tables here would be ignored; remove one or the other".into(),
            );
        }
        (Some(sock), None) => (BrokerSource::Reuse(dir.join(sock)), None),
        (None, Some(cfg)) => {
            if !file.streams.is_empty() || file.broker.is_some() {
                return Err(format!(
                    "[launch] config = {:?} names the broker's config, and this file also has [[stream]] or [broker] tables; keep one",
                    cfg
                ));
            }
            let cfg_path = dir.join(cfg);
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|e| format!("[launch] config: cannot read {}: {e}", cfg_path.display()))?;
            let table: toml::Table = toml::from_str(&text)
                .map_err(|e| format!("[launch] config {}: {e}", cfg_path.display()))?;
            let cfg_dir = cfg_path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (
                BrokerSource::Start {
                    config: String::new(),
                    dir: cfg_dir,
                },
                Some(table),
            )
        }
        (None, None) => {
            if file.streams.is_empty() {
                return Err(
                    "no broker to use: add [[stream]] tables, `config = \"broker.toml\"` or `socket = \"…\"` (a running broker) under [launch]".into(),
                );
            }
            let mut table = toml::Table::new();
            if let Some(b) = &file.broker {
                table.insert("broker".into(), toml::Value::Table(b.clone()));
            }
            table.insert(
                "stream".into(),
                toml::Value::Array(
                    file.streams
                        .iter()
                        .cloned()
                        .map(toml::Value::Table)
                        .collect(),
                ),
            );
            (
                BrokerSource::Start {
                    config: String::new(),
                    dir: dir.to_path_buf(),
                },
                Some(table),
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::launch::expand::{ExpandError, substitute};
    use batchcast_broker::config::StreamToml;

    fn host(gpus: usize) -> Host {
        Host {
            gpus: (0..gpus).map(|i| format!("{}", i + 4)).collect(),
            exe: PathBuf::from("/opt/bc/batchcast"),
        }
    }

    fn parse(trainers: &str, gpus: usize) -> Result<Sweep, SpecError> {
        let stream = StreamToml::synthetic("train", 8, 64, &[("x", "u8", &[4])]).to_toml();
        let text = format!("{stream}\n{trainers}");
        Sweep::parse(&text, Path::new("/tmp/sweep.toml"), &host(gpus))
    }

    #[test]
    fn placeholders_are_substituted_and_unknown_ones_named() {
        let vars: BTreeMap<String, String> = [("lr".to_string(), "0.1".to_string())]
            .into_iter()
            .collect();
        assert_eq!(substitute("--lr={lr}", &vars).unwrap(), "--lr=0.1");
        assert_eq!(substitute("{{lr}}", &vars).unwrap(), "{lr}");
        let e = substitute("{seed}", &vars).unwrap_err().to_string();
        assert!(e.contains("{seed}") && e.contains("{lr}"), "{e}");
        assert!(matches!(
            substitute("{lr", &vars),
            Err(ExpandError::UnclosedBrace { .. })
        ));
    }

    #[test]
    fn a_grid_expands_to_every_combination_times_copies_with_gpus_round_robin() {
        let s = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\", \"--lr\", \"{lr}\", \"--seed\", \"{seed}\"]\ngrid = { lr = [0.1, 0.01], seed = [1, 2] }\ncopies = 2\nenv = { RUN = \"{name}@{gpu}\" }\n",
            3,
        )
        .unwrap();
        assert_eq!(s.trainers.len(), 8);
        let t = &s.trainers[3];
        assert_eq!(t.name, "m-3");
        assert_eq!(t.argv[1..], ["--lr", "0.1", "--seed", "2"]);
        let gpus: Vec<_> = s.trainers.iter().map(|t| t.gpu.clone().unwrap()).collect();
        assert_eq!(gpus, ["4", "5", "6", "4", "5", "6", "4", "5"]);
        assert_eq!(t.env, [("RUN".to_string(), "m-3@4".to_string())]);
        // The stream waits for all eight.
        let BrokerSource::Start { config, .. } = &s.broker else {
            panic!()
        };
        assert!(config.contains("min_consumers = 8"), "{config}");
    }

    /// A typo or a missing folder in the sweep file's own [[stream]] is
    /// named against the sweep file and the stream, at parse (before a
    /// run folder or a broker exists), not against the config the run
    /// would write.
    #[test]
    fn an_inline_streams_typo_or_missing_folder_names_the_sweep_file() {
        let trainer = "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\n";
        let err = |text: &str| {
            let Err(e) = Sweep::parse(text, Path::new("/tmp/sweep.toml"), &host(0)) else {
                panic!("{text} was not refused")
            };
            let said = e.to_string();
            assert!(said.contains("/tmp/sweep.toml"), "{said}");
            assert!(!said.contains("broker.toml"), "{said}");
            said
        };
        let typo = format!(
            "[[stream]]\nname = \"train\"\nbatchsize = 8\n[stream.synthetic]\nlen = 8\nfields = [{{ name = \"x\", dtype = \"u8\", shape = [4] }}]\n{trainer}"
        );
        let said = err(&typo);
        assert!(
            said.contains("[[stream]] `train`") && said.contains("batchsize"),
            "{said}"
        );
        let missing = format!(
            "[[stream]]\nname = \"photos\"\nbatch_size = 8\n[stream.image_folder]\nroot = \"no/such/folder\"\n[stream.transform]\nresize = 8\n{trainer}"
        );
        let said = err(&missing);
        assert!(
            said.contains("[[stream]] `photos`") && said.contains("no/such/folder"),
            "{said}"
        );
        let broker = format!(
            "[broker]\nmemory_mb = 64\n{}",
            typo.replace("batchsize", "batch_size")
        );
        let said = err(&broker);
        assert!(
            said.contains("[broker]") && said.contains("memory_mb"),
            "{said}"
        );
    }

    /// `zip` pairs each batch size with its own learning rate (one
    /// trainer per position), crossed with `grid`; lists of other lengths
    /// and a key in both are refused, naming them.
    #[test]
    fn a_zip_pairs_each_batch_size_with_its_own_learning_rate() {
        let s = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\", \"--lr\", \"{lr}\", \"--seed\", \"{seed}\"]\nzip = { batch_size = [32, 64, 128], lr = [0.1, 0.2, 0.4] }\ngrid = { seed = [1, 2] }\n",
            0,
        )
        .unwrap();
        let got: Vec<(String, String, String)> = s
            .trainers
            .iter()
            .map(|t| {
                let bs = t
                    .env
                    .iter()
                    .find(|(k, _)| k == env_var("batch_size"))
                    .map(|(_, v)| v.clone())
                    .unwrap();
                (bs, t.argv[2].clone(), t.argv[4].clone())
            })
            .collect();
        let want: Vec<(String, String, String)> = [
            ("32", "0.1", "1"),
            ("32", "0.1", "2"),
            ("64", "0.2", "1"),
            ("64", "0.2", "2"),
            ("128", "0.4", "1"),
            ("128", "0.4", "2"),
        ]
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
        assert_eq!(got, want);
        let err = |trainer: &str| match parse(trainer, 0) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{trainer} was not refused"),
        };
        let said = err(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\nzip = { batch_size = [32, 64], lr = [0.1] }\n",
        );
        assert!(
            said.contains("zip.lr has 1 values where zip.batch_size has 2"),
            "{said}"
        );
        let said = err(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\nzip = { lr = [0.1] }\ngrid = { lr = [0.2] }\n",
        );
        assert!(said.contains("lr is in both grid and zip"), "{said}");
    }

    #[test]
    fn a_grid_over_batch_sizes_sizes_the_streams_ring() {
        let s = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\ngrid = { batch_size = [64, 256, 128] }\n",
            0,
        )
        .unwrap();
        let BrokerSource::Start { config, .. } = &s.broker else {
            panic!()
        };
        assert!(config.contains("max_batch_size = 256"), "{config}");
        // The broker plans it: the ring holds batches of 256 over units of 8.
        let cfg = batchcast_broker::config::Config::parse(config, Path::new("b.toml")).unwrap();
        let plans = batchcast_broker::plan::plan_config(&cfg).unwrap();
        assert_eq!(plans[0].slots, 3 * (255u32.div_ceil(8) + 1));
        // A larger max_batch_size in the config stays; a smaller one rises.
        let stream = StreamToml::synthetic("train", 8, 64, &[("x", "u8", &[4])]).to_toml();
        for (given, want) in [(512, 512), (100, 256)] {
            let text = format!(
                "{}\nmax_batch_size = {given}\n[stream.synthetic]{}\n[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\ngrid = {{ batch_size = [64, 256] }}\n",
                stream
                    .split("[stream.synthetic]")
                    .next()
                    .unwrap()
                    .trim_end(),
                stream.split("[stream.synthetic]").nth(1).unwrap()
            );
            let s = Sweep::parse(&text, Path::new("/tmp/sweep.toml"), &host(0)).unwrap();
            let BrokerSource::Start { config, .. } = &s.broker else {
                panic!()
            };
            assert!(
                config.contains(&format!("max_batch_size = {want}")),
                "{config}"
            );
        }
    }

    #[test]
    fn a_trainers_join_reaches_its_consumer() {
        let s = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\njoin = \"now\"\n",
            0,
        )
        .unwrap();
        assert_eq!(
            s.trainers[0].env,
            [(env_var("join").to_string(), "now".to_string())]
        );
    }

    #[test]
    fn gpu_indices_are_checked_against_the_machine() {
        let e = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\ngpu = [0, 2]\n",
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("GPU 2 does not exist") && e.contains("2 GPUs"),
            "{e}"
        );
        let s = parse("[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\n", 0).unwrap();
        assert_eq!(s.trainers[0].gpu, None, "no GPU: nothing assigned");
        let s = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\ngpu = \"none\"\n",
            2,
        )
        .unwrap();
        assert_eq!(s.trainers[0].gpu, None);
    }

    #[test]
    fn duplicate_names_and_bad_values_are_refused() {
        let e = parse(
            "[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\n[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\n",
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("two trainers would be named `m`"), "{e}");
        for (bad, expect) in [
            ("copies = 0", "copies = 0"),
            ("grid = { lr = [] }", "grid.lr is an empty list"),
            ("gpu = \"all\"", "round-robin"),
            ("cwd = \"/no/such/folder\"", "is not a folder"),
            ("join = \"later\"", "join: join `later`"),
        ] {
            let e = parse(
                &format!("[[trainer]]\nname = \"m\"\ncommand = [\"sh\"]\n{bad}\n"),
                0,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(expect), "{bad}: {e}");
        }
        let e = parse("[[trainer]]\nname = \"a b\"\ncommand = [\"sh\"]\n", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("letters, digits"), "{e}");
    }
}
