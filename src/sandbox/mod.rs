//! The sandbox: an in-memory Kubernetes API server and simulated controllers for tests and demos.
