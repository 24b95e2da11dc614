//! The command line's tools, apart from the broker's core (config → plan
//! → pipeline → hub → stream → server): the test consumer (`consume`), the
//! demo and its dataset, the stats table, the launcher, and the process
//! plumbing the demo, the benchmarks and the tests share (`harness`,
//! `child`, `procstat`).

pub mod child;
pub mod consume;
pub mod demo;
pub mod demo_images;
pub mod harness;
pub mod launch;
pub mod procstat;
pub mod stats_view;
