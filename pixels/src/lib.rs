//! batchcast's per-image work, apart from the broker: encoded bytes to RGB
//! pixels (`decode`), torchvision's transforms written straight into a
//! tensor (`transform`), its augmentations (`augment`) and random erasing
//! (`erase`), all drawn from a sample's seeded plan (`random`).
//!
//! A crate of its own so that it alone is optimised in debug builds: these
//! pixel loops are what the tests spend their time in, while the broker
//! (sockets, scheduling, the command line) builds faster unoptimised
//! (docs/development.md, "Set up and run").

pub mod augment;
pub mod decode;
pub mod erase;
pub mod layout;
pub mod random;
pub mod transform;
