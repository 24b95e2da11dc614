//! Expanding a sweep's `[[trainer]]` tables into trainers: grids of
//! values, copies, GPUs (round-robin, fixed, or a list), `{key}`
//! substitution in commands and environment, and finding each program.

use batchcast::options::env_var;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::file::{GpuSpec, Host, SweepFile, TrainerPlan, TrainerSpec, ordinal};

/// What is wrong with a `[[trainer]]` table, or with the trainers it
/// expands to; each says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    /// Where in the file: a trainer table, one of its keys.
    #[error("{context}: {source}")]
    In {
        context: String,
        source: Box<ExpandError>,
    },
    #[error("{what}: GPU {index} does not exist: this machine shows {count} GPU{}{}",
        if *count == 1 { "" } else { "s" },
        if *count == 0 { " (no CUDA driver or device); use gpu = \"none\"".to_string() } else { format!(" (0..{})", count - 1) })]
    NoSuchGpu {
        what: String,
        index: u32,
        count: usize,
    },
    #[error("{value} is not a string, number or boolean ({kind})")]
    NotAValue { value: String, kind: &'static str },
    #[error("`{text}` has an unmatched `}}` (write `}}}}` for a brace)")]
    UnmatchedBrace { text: String },
    #[error("`{text}` has an unclosed `{{` (write `{{{{` for a brace)")]
    UnclosedBrace { text: String },
    #[error("`{text}` uses {{{key}}}, which is not defined; placeholders here: {defined}")]
    Undefined {
        text: String,
        key: String,
        defined: String,
    },
    #[error("batch_size {text:?} is not a whole number ≥ 1 (a trainer's own batch size)")]
    BatchSize { text: String },
    #[error("name {name:?} must be letters, digits, `-`, `_` or `.` (it names log files)")]
    Name { name: String },
    #[error(
        "`command` is empty; give the program and its arguments, e.g. [\"python\", \"train.py\"]"
    )]
    EmptyCommand,
    #[error("`baseline_command` is empty")]
    EmptyBaseline,
    #[error("copies = 0 starts nothing; remove the trainer or use copies ≥ 1")]
    NoCopies,
    #[error("grid.{key} is an empty list")]
    EmptyGrid { key: String },
    #[error(
        "zip.{key} has {len} values where zip.{first} has {want}: zip pairs the i-th value of each list, so give them one length (or use grid for every combination)"
    )]
    ZipLengths {
        key: String,
        len: usize,
        first: String,
        want: usize,
    },
    #[error("{key} is in both grid and zip; give it in one")]
    GridAndZip { key: String },
    #[error("grid.{key} would hide the built-in {{{key}}}; rename it")]
    HidesBuiltin { key: String },
    #[error("gpu = {word:?}: use \"round-robin\", \"none\", a GPU index, or a list of indices")]
    GpuWord { word: String },
    #[error("gpu = [] is empty; use \"none\" for no GPU")]
    NoGpus,
    #[error("cwd {0} is not a folder")]
    Cwd(String),
    #[error("join: {0}")]
    Join(String),
    #[error("command {prog} does not exist (looked in {dir})")]
    NoSuchFile { prog: String, dir: String },
    #[error("command `{prog}` is not next to {exe} nor on PATH{hint}")]
    NotFound {
        prog: String,
        exe: String,
        hint: &'static str,
    },
    #[error(
        "two trainers would be named `{name}` ({first} and {second}); give them different names"
    )]
    SameName {
        name: String,
        first: String,
        second: String,
    },
    #[error(
        "{what} subscribes to stream `{stream}`, which the broker config does not define (it has: {known})"
    )]
    UnknownStream {
        what: String,
        stream: String,
        known: String,
    },
}

impl ExpandError {
    /// This error, said of `context` (a trainer table, a key of it).
    fn within(self, context: impl Into<String>) -> ExpandError {
        ExpandError::In {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

pub(super) fn gpu_value(host: &Host, i: u32, what: &str) -> Result<String, ExpandError> {
    host.gpus
        .get(i as usize)
        .cloned()
        .ok_or_else(|| ExpandError::NoSuchGpu {
            what: what.to_string(),
            index: i,
            count: host.gpus.len(),
        })
}

fn value_text(v: &toml::Value) -> Result<String, ExpandError> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(ExpandError::NotAValue {
            value: other.to_string(),
            kind: other.type_str(),
        }),
    }
}

/// Replaces `{key}` with `vars[key]`; `{{` and `}}` are literal braces.
pub fn substitute(s: &str, vars: &BTreeMap<String, String>) -> Result<String, ExpandError> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if tail.starts_with('}') {
            return Err(ExpandError::UnmatchedBrace { text: s.into() });
        }
        let Some(end) = tail.find('}') else {
            return Err(ExpandError::UnclosedBrace { text: s.into() });
        };
        let key = &tail[1..end];
        let v = vars.get(key).ok_or_else(|| ExpandError::Undefined {
            text: s.into(),
            key: key.into(),
            defined: vars
                .keys()
                .map(|k| format!("{{{k}}}"))
                .collect::<Vec<_>>()
                .join(" "),
        })?;
        out.push_str(v);
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// One `[[trainer]]` table, expanded: a trainer per combination of its
/// grid's values, times `copies`, each with its GPU, name and command.
fn expand_trainer(
    t: &TrainerSpec,
    what: &str,
    host: &Host,
    gpus: &[String],
    rr: &mut usize,
    default_stream: &str,
    dir: &Path,
) -> Result<Vec<TrainerPlan>, ExpandError> {
    let e = |m: ExpandError| m.within(what);
    check_trainer(t).map_err(e)?;
    let combos = grid_combinations(t).map_err(e)?;
    let copies = t.copies.unwrap_or(1) as usize;
    let total = combos.len() * copies;
    let gpu_for = gpu_assignment(t, what, host, gpus, rr, total)?;
    let cwd = match &t.cwd {
        Some(c) => dir.join(c),
        None => dir.to_path_buf(),
    };
    if !cwd.is_dir() {
        return Err(e(ExpandError::Cwd(cwd.display().to_string())));
    }
    let mut out = Vec::with_capacity(total);
    for (index, combo) in combos
        .iter()
        .flat_map(|c| std::iter::repeat_n(c, copies))
        .enumerate()
    {
        let name = if total == 1 {
            t.name.clone()
        } else {
            format!("{}-{index}", t.name)
        };
        let gpu = gpu_for[index].clone();
        let mut vars = combo.clone();
        vars.insert("name".into(), name.clone());
        vars.insert("index".into(), index.to_string());
        vars.insert("gpu".into(), gpu.clone().unwrap_or_default());
        vars.insert("batchcast".into(), host.exe.display().to_string());
        let command = |v: &[String]| -> Result<Vec<String>, ExpandError> {
            let mut argv = v
                .iter()
                .map(|a| substitute(a, &vars).map_err(&e))
                .collect::<Result<Vec<_>, _>>()?;
            argv[0] = resolve_program(&argv[0], &cwd, &host.exe).map_err(&e)?;
            Ok(argv)
        };
        let argv = command(&t.command)?;
        let baseline_argv = t.baseline_command.as_deref().map(command).transpose()?;
        let env = t
            .env
            .iter()
            .map(|(k, v)| {
                let text = value_text(v).map_err(|m| e(m.within(format!("env.{k}"))))?;
                Ok((k.clone(), substitute(&text, &vars).map_err(&e)?))
            })
            .collect::<Result<Vec<_>, ExpandError>>()?;
        let mut env = env;
        if let Some(bs) = trainer_batch_size(t, &vars).map_err(&e)? {
            env.push((env_var("batch_size").into(), bs.to_string()));
        }
        if let Some(join) = &t.join {
            join.parse::<batchcast::JoinPolicy>()
                .map_err(|m| e(ExpandError::Join(m.to_string())))?;
            env.push((env_var("join").into(), join.clone()));
        }
        out.push(TrainerPlan {
            name,
            argv,
            baseline_argv,
            env,
            cwd: cwd.clone(),
            stream: t.stream.clone().unwrap_or_else(|| default_stream.into()),
            gpu,
        });
    }
    Ok(out)
}

/// A trainer's own batch size: its `batch_size` key (placeholders
/// substituted), else its grid's `batch_size` value; a whole number ≥ 1.
fn trainer_batch_size(
    t: &TrainerSpec,
    vars: &BTreeMap<String, String>,
) -> Result<Option<u64>, ExpandError> {
    let text = match &t.batch_size {
        Some(v) => substitute(&value_text(v).map_err(|m| m.within("batch_size"))?, vars)?,
        None => match vars.get("batch_size") {
            Some(v) if t.grid.contains_key("batch_size") || t.zip.contains_key("batch_size") => {
                v.clone()
            }
            _ => return Ok(None),
        },
    };
    match text.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(Some(n)),
        _ => Err(ExpandError::BatchSize { text }),
    }
}

/// What a trainer table must hold before it is expanded.
fn check_trainer(t: &TrainerSpec) -> Result<(), ExpandError> {
    if t.name.is_empty()
        || !t
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(ExpandError::Name {
            name: t.name.clone(),
        });
    }
    if t.command.is_empty() || t.command[0].is_empty() {
        return Err(ExpandError::EmptyCommand);
    }
    if t.baseline_command.as_ref().is_some_and(|c| c.is_empty()) {
        return Err(ExpandError::EmptyBaseline);
    }
    if t.copies == Some(0) {
        return Err(ExpandError::NoCopies);
    }
    Ok(())
}

/// A grid's or zip's list as texts, checked: not empty, not a built-in's name.
fn list_texts(table: &str, key: &str, values: &[toml::Value]) -> Result<Vec<String>, ExpandError> {
    if values.is_empty() {
        return Err(ExpandError::EmptyGrid { key: key.into() });
    }
    if matches!(key, "name" | "index" | "gpu" | "batchcast") {
        return Err(ExpandError::HidesBuiltin { key: key.into() });
    }
    values
        .iter()
        .map(|v| value_text(v).map_err(|m| m.within(format!("{table}.{key}"))))
        .collect()
}

/// The zip's rows: the i-th value of each list together (one empty row
/// without a zip).
fn zip_rows(t: &TrainerSpec) -> Result<Vec<BTreeMap<String, String>>, ExpandError> {
    let mut rows: Vec<BTreeMap<String, String>> = Vec::new();
    let mut first: Option<(&String, usize)> = None;
    for (key, values) in &t.zip {
        if t.grid.contains_key(key) {
            return Err(ExpandError::GridAndZip { key: key.clone() });
        }
        let texts = list_texts("zip", key, values)?;
        match first {
            None => {
                first = Some((key, texts.len()));
                rows = vec![BTreeMap::new(); texts.len()];
            }
            Some((f, want)) if want != texts.len() => {
                return Err(ExpandError::ZipLengths {
                    key: key.clone(),
                    len: texts.len(),
                    first: f.clone(),
                    want,
                });
            }
            Some(_) => {}
        }
        for (row, v) in rows.iter_mut().zip(texts) {
            row.insert(key.clone(), v);
        }
    }
    if rows.is_empty() {
        rows.push(BTreeMap::new());
    }
    Ok(rows)
}

/// Every combination of the grid's values, each with every row of the
/// zip (one empty one without either).
fn grid_combinations(t: &TrainerSpec) -> Result<Vec<BTreeMap<String, String>>, ExpandError> {
    let mut combos: Vec<BTreeMap<String, String>> = zip_rows(t)?;
    for (key, values) in &t.grid {
        let texts = list_texts("grid", key, values)?;
        combos = combos
            .into_iter()
            .flat_map(|c| {
                texts.iter().map(move |v| {
                    let mut c = c.clone();
                    c.insert(key.clone(), v.clone());
                    c
                })
            })
            .collect();
    }
    Ok(combos)
}

/// The GPU of each of a table's `total` trainers.
fn gpu_assignment(
    t: &TrainerSpec,
    what: &str,
    host: &Host,
    gpus: &[String],
    rr: &mut usize,
    total: usize,
) -> Result<Vec<Option<String>>, ExpandError> {
    Ok(match &t.gpu {
        None => round_robin(gpus, rr, total),
        Some(GpuSpec::Word(w)) if w == "round-robin" => round_robin(gpus, rr, total),
        Some(GpuSpec::Word(w)) if w == "none" => vec![None; total],
        Some(GpuSpec::Word(w)) => {
            return Err(ExpandError::GpuWord { word: w.clone() }.within(what));
        }
        Some(GpuSpec::One(i)) => vec![Some(gpu_value(host, *i, &format!("{what}: gpu"))?); total],
        Some(GpuSpec::List(list)) => {
            if list.is_empty() {
                return Err(ExpandError::NoGpus.within(what));
            }
            let vals = list
                .iter()
                .map(|&i| gpu_value(host, i, &format!("{what}: gpu")))
                .collect::<Result<Vec<_>, _>>()?;
            (0..total)
                .map(|k| Some(vals[k % vals.len()].clone()))
                .collect()
        }
    })
}

fn round_robin(gpus: &[String], rr: &mut usize, n: usize) -> Vec<Option<String>> {
    (0..n)
        .map(|_| {
            if gpus.is_empty() {
                return None;
            }
            let g = gpus[*rr % gpus.len()].clone();
            *rr += 1;
            Some(g)
        })
        .collect()
}

/// A program as the trainer's command names it: a path (relative to the
/// trainer's folder), or a name looked up next to this executable first
/// (so `rust-consumer` built in the same target folder is found), then on
/// `PATH`.
fn resolve_program(prog: &str, cwd: &Path, exe: &Path) -> Result<String, ExpandError> {
    if prog.contains('/') {
        let p = cwd.join(prog);
        return if p.is_file() {
            Ok(p.display().to_string())
        } else {
            Err(ExpandError::NoSuchFile {
                prog: prog.into(),
                dir: cwd.display().to_string(),
            })
        };
    }
    let sibling = exe.parent().map(|d| d.join(prog));
    if let Some(s) = sibling.filter(|s| s.is_file()) {
        return Ok(s.display().to_string());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| d.join(prog).is_file()) {
        return Ok(prog.to_string());
    }
    Err(ExpandError::NotFound {
        prog: prog.into(),
        exe: exe.display().to_string(),
        hint: if prog == "rust-consumer" {
            "; build it with `cargo build --release` (the example trainers are built with the workspace)"
        } else {
            ""
        },
    })
}

/// Every trainer of the file, expanded (grids, GPUs), with distinct names
/// and streams the broker serves.
pub(super) fn expand_trainers(
    file: &SweepFile,
    host: &Host,
    gpus: &[String],
    default_stream: &str,
    dir: &Path,
    streams: &[String],
) -> Result<Vec<TrainerPlan>, ExpandError> {
    let mut trainers = Vec::new();
    let mut rr = 0usize;
    let mut names = HashMap::new();
    for (t_i, t) in file.trainers.iter().enumerate() {
        let what = format!("trainer `{}` (the {} [[trainer]])", t.name, ordinal(t_i));
        let expanded = expand_trainer(t, &what, host, gpus, &mut rr, default_stream, dir)?;
        for p in expanded {
            if let Some(prev) = names.insert(p.name.clone(), what.clone()) {
                return Err(ExpandError::SameName {
                    name: p.name,
                    first: prev,
                    second: what,
                });
            }
            if !streams.is_empty() && !streams.contains(&p.stream) {
                return Err(ExpandError::UnknownStream {
                    what,
                    stream: p.stream,
                    known: streams.join(", "),
                });
            }
            trainers.push(p);
        }
    }
    Ok(trainers)
}
