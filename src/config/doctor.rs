//! `[doctor]`: the preflight run before the server roles. Nothing here is checked beyond its
//! type.

use serde::{Deserialize, Serialize};

/// `[doctor]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DoctorConfig {
    /// Do not run the preflight before `extender` / `device-plugin` start.
    pub skip: bool,
}
