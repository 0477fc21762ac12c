//! The `nvidia-smi` backend (being written): runs `nvidia-smi -q -x` and parses its XML.

use tokio::sync::mpsc;

use super::{Error, GpuBackend, HealthEvent, Inventory};

/// How to run nvidia-smi.
#[derive(Clone, Debug)]
pub struct NvidiaSmiOptions {
    /// The program (a name on PATH or a path).
    pub program: String,
}

impl NvidiaSmiOptions {
    /// Defaults for `program`.
    pub fn new(program: &str) -> NvidiaSmiOptions {
        NvidiaSmiOptions {
            program: program.to_string(),
        }
    }
}

/// nvidia-smi as a GPU backend.
#[derive(Debug)]
pub struct NvidiaSmiBackend {
    options: NvidiaSmiOptions,
}

impl NvidiaSmiBackend {
    /// Runs nvidia-smi once to prove it works.
    pub fn open(options: NvidiaSmiOptions) -> Result<NvidiaSmiBackend, Error> {
        Err(Error::NvidiaSmi(format!(
            "{}: not implemented yet",
            options.program
        )))
    }
}

impl GpuBackend for NvidiaSmiBackend {
    fn name(&self) -> &'static str {
        "nvidia-smi"
    }
    fn inventory(&self) -> Result<Inventory, Error> {
        Err(Error::NvidiaSmi(format!(
            "{}: not implemented yet",
            self.options.program
        )))
    }
    fn watch_health(&self) -> Result<mpsc::Receiver<HealthEvent>, Error> {
        Err(Error::NvidiaSmi("not implemented yet".to_string()))
    }
}
