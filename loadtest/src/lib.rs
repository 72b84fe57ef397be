//! headroom-loadtest: streaming clients that measure what users feel, load drivers and reports.
