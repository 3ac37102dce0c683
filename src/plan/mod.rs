//! Teardown plans as data: parsing, validation and the dependency graph.
