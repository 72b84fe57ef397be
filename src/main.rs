//! The `headroom` command line: parses, dispatches to the crates, sets the exit code.

fn main() {}
