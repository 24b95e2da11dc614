//! `consume`'s flags to [`ConsumerOptions`]: each consumer option's flag
//! is a row of [`batchcast::options::CONSUMER_OPTIONS`] (the tests below
//! check the flags, their help's environment variables and a refused value
//! of each against the table); a flag left out keeps the option's default,
//! its environment variable's where it has one.

use std::time::Duration;

use batchcast::{ConsumerOptions, JoinPolicy};
use batchcast_cli::report::SavedState;

use super::{ConsumeArgs, Join};

/// A number of seconds ≥ 0 given as `flag`.
fn seconds(flag: &str, t: f64) -> Result<Duration, String> {
    if t.is_finite() && t >= 0.0 {
        Ok(Duration::from_secs_f64(t))
    } else {
        Err(format!("{flag} {t} must be a number of seconds ≥ 0"))
    }
}

/// The consumer's options from the command line, checked as the client
/// checks them before connecting, and the state file it resumes from.
pub(super) fn from_args(
    args: &ConsumeArgs,
) -> Result<(ConsumerOptions, Option<SavedState>), String> {
    let mut opts = ConsumerOptions::default();
    if let Some(s) = &args.stream {
        opts.stream = s.clone();
    }
    if let Some(n) = &args.name {
        opts.name = n.clone();
    }
    opts.socket = args.socket.clone();
    opts.window = args.window;
    if args.batch_size.is_some() {
        opts.batch_size = args.batch_size;
    }
    opts.drop_last = args.drop_last;
    if args.no_mailbox {
        opts.mailbox = false;
    }
    if let Some(d) = args.device {
        opts.device = d;
    }
    if let Some(t) = args.connect_timeout {
        opts.connect_timeout = seconds("--connect-timeout", t)?;
    }
    if let Some(t) = args.reconnect_timeout {
        opts.reconnect_timeout = seconds("--reconnect-timeout", t)?;
    }
    if let Some(join) = args.join {
        opts.join = match join {
            Join::NextEpoch => JoinPolicy::NextEpoch,
            Join::Immediate => JoinPolicy::Immediate,
            Join::Now => JoinPolicy::Now,
        };
    }
    opts.resume = args.resume;
    let saved = args
        .resume_state
        .as_deref()
        .map(SavedState::load)
        .transpose()
        .map_err(|e| format!("--resume-state: {e}"))?;
    opts.state = saved.as_ref().map(|s| s.state.clone());
    opts.group = seat(args).map_err(|e| format!("--group: {e}"))?;
    opts.validate().map_err(|e| e.to_string())?;
    Ok((opts, saved))
}

/// The seat `--group` asks for, if any.
fn seat(args: &ConsumeArgs) -> Result<Option<batchcast::proto::Seat>, batchcast::proto::SeatError> {
    let Some(name) = &args.group else {
        return Ok(None);
    };
    let seat = match (args.rank, args.world) {
        (Some(rank), Some(world)) => batchcast::proto::Seat {
            name: name.clone(),
            rank,
            world,
            replicate: args.replicate,
        },
        (None, None) => batchcast::proto::Seat {
            replicate: args.replicate,
            ..batchcast::group_from_env(name)?
        },
        _ => return Err(batchcast::proto::SeatError::HalfGiven),
    };
    Ok(Some(seat))
}

#[cfg(test)]
mod tests {
    use batchcast::options::CONSUMER_OPTIONS;
    use clap::{Args, FromArgMatches};

    use super::*;

    fn command() -> clap::Command {
        ConsumeArgs::augment_args(clap::Command::new("consume"))
    }

    /// `consume ARGS`, parsed and turned into options (without connecting).
    fn parse(args: &[&str]) -> Result<ConsumerOptions, String> {
        let m = command()
            .try_get_matches_from(std::iter::once("consume").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        let a = ConsumeArgs::from_arg_matches(&m).map_err(|e| e.to_string())?;
        from_args(&a).map(|(o, _)| o)
    }

    #[test]
    fn each_cli_option_has_its_flag_and_its_help_names_its_variable() {
        let cmd = command();
        for o in CONSUMER_OPTIONS.iter().filter(|o| o.on.cli) {
            let flag = o.cli_flag();
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long().is_some_and(|l| format!("--{l}") == flag))
                .unwrap_or_else(|| panic!("{}: consume has no {flag}", o.name));
            if let Some(var) = o.env {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                assert!(
                    help.contains(var),
                    "{flag}'s help does not name ${var}: {help}"
                );
            }
        }
    }

    #[test]
    fn a_refused_value_is_refused_naming_the_flag_or_the_option() {
        for o in CONSUMER_OPTIONS.iter().filter(|o| o.on.cli) {
            let Some(bad) = o.refused else { continue };
            // The table writes Python literals: strings quoted, `\u` escapes.
            let value = serde_json::from_str::<String>(bad).unwrap_or_else(|_| bad.to_owned());
            let flag = o.cli_flag();
            let mut args = vec![format!("{flag}={value}")];
            if ["rank", "world", "replicate"].contains(&o.name) {
                args.push("--group=g".into());
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let err = parse(&args).expect_err(&format!("{flag}={value:?} was taken"));
            assert!(
                err.contains(&flag) || err.contains(o.name),
                "{flag}={value:?}: the error names neither: {err}"
            );
        }
    }

    #[test]
    fn flags_left_out_keep_the_defaults() {
        let o = parse(&[]).unwrap();
        let d = ConsumerOptions::default();
        assert_eq!(
            (o.window, o.connect_timeout, o.reconnect_timeout, o.mailbox),
            (d.window, d.connect_timeout, d.reconnect_timeout, d.mailbox)
        );
    }
}
