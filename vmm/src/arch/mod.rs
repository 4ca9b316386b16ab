//! Architecture-specific boot details. Only x86_64 is supported.

pub mod x86_64;
