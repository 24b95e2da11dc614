//! What `batchcast doctor` finds about a stream: the bound, the verdict,
//! its evidence and the model's predictions (what the text, the JSON and
//! the HTML report show).

use super::predict::{Inputs, Prediction, Rate};

/// What limits a stream's trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// Nothing moved while it watched.
    Idle,
    /// The trainers rarely wait for data: faster data buys nothing.
    Trainer,
    /// The pipeline threads are busy, most of their time in this stage.
    Read,
    Decode,
    Transform,
    /// The pipeline waits for slots while trainers wait: flow (a holder,
    /// too few slots), not work.
    Flow,
    /// A producer's stream: its producer sets the pace.
    Producer,
    /// A synthetic stream's threads are busy making it.
    Pipeline,
}

/// One stream's diagnosis.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finding {
    pub stream: String,
    pub bound: Bound,
    /// The sentence a person acts on.
    pub verdict: String,
    /// The numbers it rests on, in order.
    pub evidence: Vec<(String, String)>,
    /// The model's inputs, its rate now, and what changes would buy
    /// ([`predict`]); none for an idle stream or a producer's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<Model>,
}

/// A stream's model: its inputs, the rate they give now (to check
/// against the measured one), and the predictions.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Model {
    pub inputs: Inputs,
    pub now: Rate,
    pub predictions: Vec<Prediction>,
}
