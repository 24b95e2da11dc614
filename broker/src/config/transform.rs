//! `[stream.transform]`: torchvision's transforms by their names and
//! parameters, as written in the config (the plan checks them).

use batchcast::DType;
use serde::Deserialize;

use crate::pipeline::augment::AffineFilter;
use crate::pipeline::transform::{Interpolation, Layout, PaddingMode};

/// `int` or `[height, width]`, as torchvision takes sizes.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Size {
    Square(u32),
    HeightWidth([u32; 2]),
}

impl Size {
    /// `(height, width)`.
    pub(crate) fn hw(self) -> (u32, u32) {
        match self {
            Size::Square(s) => (s, s),
            Size::HeightWidth([h, w]) => (h, w),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomResizedCropConfig {
    pub size: Size,
    #[serde(default = "default_scale")]
    pub scale: [f64; 2],
    #[serde(default = "default_ratio")]
    pub ratio: [f64; 2],
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NormalizeConfig {
    pub mean: [f64; 3],
    pub std: [f64; 3],
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformConfig {
    pub random_resized_crop: Option<RandomResizedCropConfig>,
    /// `Resize`: an int is the shorter side (then a crop must follow),
    /// `[h, w]` the exact size.
    pub resize: Option<Size>,
    pub center_crop: Option<Size>,
    /// `RandomCrop(size, padding, pad_if_needed, fill, padding_mode)`.
    pub random_crop: Option<RandomCropConfig>,
    /// `Pad(padding, fill, padding_mode)`, after the crop.
    pub pad: Option<PadConfig>,
    /// The resampling of `resize` and `random_resized_crop` (their
    /// `interpolation`).
    #[serde(default)]
    pub interpolation: Interpolation,
    /// Probability of a horizontal flip.
    #[serde(default)]
    pub horizontal_flip: f64,
    pub normalize: Option<NormalizeConfig>,
    #[serde(default = "default_dtype")]
    pub dtype: DType,
    #[serde(default)]
    pub(crate) layout: Layout,
    /// Probability of a vertical flip (after the horizontal one).
    #[serde(default)]
    pub(crate) vertical_flip: f64,
    /// `ColorJitter(brightness, contrast, saturation, hue)`.
    pub color_jitter: Option<ColorJitterConfig>,
    /// `RandomGrayscale(p)`.
    #[serde(default)]
    pub(crate) grayscale: f64,
    /// `RandomApply([GaussianBlur(kernel_size, sigma)], p)`.
    pub gaussian_blur: Option<GaussianBlurConfig>,
    /// `TrivialAugmentWide()`: `true`, or `{ num_magnitude_bins = 31,
    /// interpolation, fill }`.
    pub trivial_augment_wide: Option<AutoAugmentSwitch>,
    /// `RandAugment(num_ops, magnitude, num_magnitude_bins, interpolation,
    /// fill)`.
    pub rand_augment: Option<RandAugmentConfig>,
    /// `AutoAugment(policy)`: `"imagenet"`, or `{ policy, interpolation,
    /// fill }`.
    pub auto_augment: Option<AutoAugmentConfig>,
    /// `RandomErasing(p, scale, ratio, value)`, on the tensor, last.
    pub random_erasing: Option<RandomErasingConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomErasingConfig {
    #[serde(default = "half")]
    pub p: f64,
    #[serde(default = "default_erase_scale")]
    pub scale: [f64; 2],
    #[serde(default = "default_erase_ratio")]
    pub ratio: [f64; 2],
    /// One value for every channel, or one per channel (in the tensor's
    /// units, after Normalize).
    #[serde(default)]
    pub value: ErasingValue,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ErasingValue {
    One(f64),
    PerChannel([f64; 3]),
    /// `"random"`: torchvision's per-element normal noise (the plan
    /// refuses other names).
    Named(String),
}

impl Default for ErasingValue {
    fn default() -> ErasingValue {
        ErasingValue::One(0.0)
    }
}

fn half() -> f64 {
    0.5
}
fn default_erase_scale() -> [f64; 2] {
    [0.02, 0.33]
}
fn default_erase_ratio() -> [f64; 2] {
    [0.3, 3.3]
}

/// torchvision's padding: `n` (all sides), `[left/right, top/bottom]` or
/// `[left, top, right, bottom]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Padding {
    All(u32),
    Sides(Vec<u32>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomCropConfig {
    pub size: Size,
    pub padding: Option<Padding>,
    #[serde(default)]
    pub pad_if_needed: bool,
    /// The padding's value (`padding_mode = "constant"`).
    #[serde(default)]
    pub fill: PadFill,
    #[serde(default)]
    pub padding_mode: PaddingMode,
}

/// `Pad`: the padding alone (zeros), or with its `fill` and `padding_mode`.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "pad = n, [lr, tb], [l, t, r, b], or { padding = ..., fill = 0 or [r, g, b], padding_mode = \"constant\" | \"edge\" | \"reflect\" | \"symmetric\" }"
)]
pub enum PadConfig {
    Zeros(Padding),
    With(PadTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PadTable {
    pub padding: Padding,
    #[serde(default)]
    pub fill: PadFill,
    #[serde(default)]
    pub padding_mode: PaddingMode,
}

/// A padding's fill, in pixel levels: one for every channel or `[r, g, b]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(
    untagged,
    expecting = "fill = a pixel level 0..255 for every channel, or [r, g, b]"
)]
pub enum PadFill {
    One(u8),
    PerChannel([u8; 3]),
}

impl Default for PadFill {
    fn default() -> PadFill {
        PadFill::One(0)
    }
}

impl PadFill {
    pub fn rgb(self) -> [u8; 3] {
        match self {
            PadFill::One(v) => [v; 3],
            PadFill::PerChannel(v) => v,
        }
    }
}

/// A `ColorJitter` amount: `x` (the factor is drawn from `[max(0, 1 - x),
/// 1 + x]`) or `[lo, hi]`, as torchvision takes them.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Jitter {
    Amount(f64),
    Range([f64; 2]),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColorJitterConfig {
    /// `RandomApply([ColorJitter(...)], p)` (default 1: always).
    #[serde(default = "one_f64")]
    pub p: f64,
    pub brightness: Option<Jitter>,
    pub contrast: Option<Jitter>,
    pub saturation: Option<Jitter>,
    pub hue: Option<Jitter>,
}

/// `RandomApply([GaussianBlur(kernel_size, sigma)], p)`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GaussianBlurConfig {
    #[serde(default = "one_f64")]
    pub p: f64,
    /// Odd; an int, or `[x, y]` as torchvision takes it.
    pub kernel_size: Size,
    /// A fixed sigma, or `[lo, hi]` to draw from (torchvision's default).
    #[serde(default = "default_sigma")]
    pub sigma: Jitter,
}

fn one_f64() -> f64 {
    1.0
}
fn default_sigma() -> Jitter {
    Jitter::Range([0.1, 2.0])
}

/// `true`/`false`, or the table of `TrivialAugmentWide`'s options.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(
    untagged,
    expecting = "trivial_augment_wide = true, false or { num_magnitude_bins = 31, interpolation = \"nearest\" | \"bilinear\" | \"bicubic\", fill = 0 or [r, g, b] }"
)]
pub enum AutoAugmentSwitch {
    On(bool),
    Table(TrivialAugmentTable),
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrivialAugmentTable {
    #[serde(default = "default_bins")]
    pub(crate) num_magnitude_bins: u32,
    #[serde(default)]
    pub interpolation: AffineFilter,
    pub fill: Option<PadFill>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandAugmentConfig {
    #[serde(default = "default_num_ops")]
    pub num_ops: u32,
    #[serde(default = "default_magnitude")]
    pub magnitude: u32,
    #[serde(default = "default_bins")]
    pub(crate) num_magnitude_bins: u32,
    #[serde(default)]
    pub interpolation: AffineFilter,
    pub fill: Option<PadFill>,
}

/// `AutoAugment(policy)`: the policy's name, or a table with the
/// geometric ops' `interpolation` and `fill`.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "auto_augment = \"imagenet\" or { policy = \"imagenet\", interpolation = \"nearest\" | \"bilinear\" | \"bicubic\", fill = 0 or [r, g, b] }"
)]
pub enum AutoAugmentConfig {
    Policy(String),
    Table(AutoAugmentTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoAugmentTable {
    pub policy: String,
    #[serde(default)]
    pub interpolation: AffineFilter,
    pub fill: Option<PadFill>,
}

fn default_bins() -> u32 {
    31
}
fn default_num_ops() -> u32 {
    2
}
fn default_magnitude() -> u32 {
    9
}

fn default_scale() -> [f64; 2] {
    [0.08, 1.0]
}
fn default_ratio() -> [f64; 2] {
    [3.0 / 4.0, 4.0 / 3.0]
}
fn default_dtype() -> DType {
    DType::F32
}
