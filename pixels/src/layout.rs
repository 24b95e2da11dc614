//! The output tensor's channel order (a stream's `layout` key).

use serde::Deserialize;

/// Channel order of the output tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Layout {
    /// `[3, H, W]`, what `ToTensor` gives.
    #[default]
    #[serde(rename = "NCHW", alias = "nchw")]
    Nchw,
    /// `[H, W, 3]`.
    #[serde(rename = "NHWC", alias = "nhwc")]
    Nhwc,
}
