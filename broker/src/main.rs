mod hub;
fn main() {}
