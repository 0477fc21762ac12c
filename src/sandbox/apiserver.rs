//! Sandbox part: apiserver. Not implemented yet.
