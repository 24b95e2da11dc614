//! A stream's [`StreamDigest`]: what its data is made from, part by part,
//! as the plan resolved it, so a consumer resuming under a changed stream
//! is refused with the parts that changed (see `batchcast::proto`'s
//! digest module for what is and is not covered).

use batchcast::proto::{Digester, StreamDigest};
use batchcast::schema::Field;

use super::StreamPlan;
use crate::config::StreamConfig;

/// The digest of a configured stream, from its config and its plan.
pub(super) fn of_config(s: &StreamConfig, plan: &StreamPlan) -> StreamDigest {
    let mut source = Digester::default();
    let mut order = Digester::default();
    plan.source.digest(&mut source, &mut order);
    order.u64(plan.schema.samples_per_epoch);
    let mut transform = Digester::default();
    if let Some(t) = &s.transform_table {
        value(&mut transform, t);
    }
    StreamDigest {
        source: source.finish(),
        order: order.finish(),
        transform: transform.finish(),
        fields: fields(&plan.schema.fields),
    }
}

/// The digest of a producer's stream: its name, epoch length and fields
/// (what it writes cannot be recomputed, so nothing resumes it by replay).
pub(super) fn of_external(plan: &StreamPlan) -> StreamDigest {
    StreamDigest {
        source: Digester::default().str("external").str(&plan.name).finish(),
        order: Digester::default()
            .u64(plan.schema.samples_per_epoch)
            .finish(),
        transform: Digester::default().finish(),
        fields: fields(&plan.schema.fields),
    }
}

fn fields(fields: &[Field]) -> u64 {
    let mut d = Digester::default();
    for f in fields {
        d.str(&f.name).str(f.dtype.name()).u64(f.shape.len() as u64);
        for &n in &f.shape {
            d.u64(n);
        }
    }
    d.finish()
}

/// A TOML value, tables in key order whatever order they were written in.
fn value(d: &mut Digester, v: &toml::Value) {
    match v {
        toml::Value::String(s) => d.str("s").str(s),
        toml::Value::Integer(i) => d.str("i").u64(*i as u64),
        toml::Value::Float(f) => d.str("f").u64(f.to_bits()),
        toml::Value::Boolean(b) => d.str("b").u64(u64::from(*b)),
        toml::Value::Datetime(t) => d.str("t").str(&t.to_string()),
        toml::Value::Array(a) => {
            d.str("a").u64(a.len() as u64);
            for x in a {
                value(d, x);
            }
            d
        }
        toml::Value::Table(t) => {
            let mut keys: Vec<&String> = t.keys().collect();
            keys.sort();
            d.str("t").u64(keys.len() as u64);
            for k in keys {
                d.str(k);
                value(d, &t[k]);
            }
            d
        }
    };
}
