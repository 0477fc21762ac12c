//! Who sends a request: the identities the sandbox knows, the bearer tokens it mints for
//! them, and authentication as kube-apiserver's token authenticators answer it.
//!
//! Every identity gets its own opaque bearer token ([`super::ApiServer::token_for`]). A request
//! is authenticated when its `Authorization: Bearer <token>` names a minted token; a missing or
//! unknown token is answered `401 Unauthorized` (an API server with `--anonymous-auth=false`:
//! the sandbox has no anonymous user). A ServiceAccount token authenticates only while its
//! ServiceAccount object exists (as upstream's token authenticator looks the account up), and
//! carries the account's `uid`. Like a pod-bound projected token, it may carry the extra
//! `authentication.kubernetes.io/node-name` (and the pod's name and uid).
//!
//! Not here: client certificates, JWT signatures or expiry, the TokenReview API,
//! impersonation (`Impersonate-*` headers are ignored, not honoured).

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// The group every authenticated identity carries.
pub const AUTHENTICATED: &str = "system:authenticated";
/// Upstream's privileged group: allowed everything, before any authorizer is asked.
pub const MASTERS: &str = "system:masters";
/// The extra key of a pod-bound ServiceAccount token that names the pod's node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// The extra key of a pod-bound token that names the pod.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// The extra key of a pod-bound token with the pod's uid.
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// The user a request is made as (upstream's `user.Info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// `system:serviceaccount:<ns>:<name>`, a user name, ...
    pub username: String,
    /// The user's uid (a ServiceAccount's object uid once authenticated); may be empty.
    pub uid: String,
    /// Groups, `system:authenticated` included.
    pub groups: Vec<String>,
    /// Extra attributes (`authentication.kubernetes.io/node-name`, ...).
    pub extra: BTreeMap<String, Vec<String>>,
}

impl Identity {
    /// The sandbox's cluster administrator, `sandbox:admin` in `system:masters`: every request
    /// is allowed (upstream's privileged group), admission still applies.
    pub fn admin() -> Identity {
        Identity::user("sandbox:admin", &[MASTERS])
    }

    /// A user named `name` in `groups` (and `system:authenticated`).
    pub fn user(name: &str, groups: &[&str]) -> Identity {
        let mut all: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        if !all.iter().any(|g| g == AUTHENTICATED) {
            all.push(AUTHENTICATED.to_string());
        }
        Identity {
            username: name.to_string(),
            uid: String::new(),
            groups: all,
            extra: BTreeMap::new(),
        }
    }

    /// ServiceAccount `namespace/name`, with the groups upstream gives it:
    /// `system:serviceaccounts`, `system:serviceaccounts:<ns>`, `system:authenticated`.
    pub fn service_account(namespace: &str, name: &str) -> Identity {
        Identity {
            username: format!("system:serviceaccount:{namespace}:{name}"),
            uid: String::new(),
            groups: vec![
                "system:serviceaccounts".to_string(),
                format!("system:serviceaccounts:{namespace}"),
                AUTHENTICATED.to_string(),
            ],
            extra: BTreeMap::new(),
        }
    }

    /// The identity with the node-name extra of a pod-bound token (Kubernetes 1.30+).
    pub fn on_node(mut self, node: &str) -> Identity {
        self.extra
            .insert(NODE_NAME_EXTRA.to_string(), vec![node.to_string()]);
        self
    }

    /// The identity with the pod name and uid extras of a pod-bound token.
    pub fn bound_to_pod(mut self, pod: &str, pod_uid: &str) -> Identity {
        self.extra
            .insert(POD_NAME_EXTRA.to_string(), vec![pod.to_string()]);
        self.extra
            .insert(POD_UID_EXTRA.to_string(), vec![pod_uid.to_string()]);
        self
    }

    /// `(namespace, name)` when this is a ServiceAccount.
    pub fn service_account_ref(&self) -> Option<(&str, &str)> {
        let rest = self.username.strip_prefix("system:serviceaccount:")?;
        let (ns, name) = rest.split_once(':')?;
        (!ns.is_empty() && !name.is_empty() && !name.contains(':')).then_some((ns, name))
    }

    /// Whether the identity is in `group`.
    pub fn in_group(&self, group: &str) -> bool {
        self.groups.iter().any(|g| g == group)
    }

    /// As an admission request's and a review's `userInfo` (empty fields left out).
    pub fn user_info(&self) -> Value {
        let mut info = json!({ "username": self.username });
        if !self.uid.is_empty() {
            info["uid"] = json!(self.uid);
        }
        if !self.groups.is_empty() {
            info["groups"] = json!(self.groups);
        }
        if !self.extra.is_empty() {
            info["extra"] = json!(self.extra);
        }
        info
    }
}

/// Why a request is not authenticated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unauthenticated {
    /// No `Authorization: Bearer` header.
    #[error("no bearer token")]
    NoToken,
    /// A token the sandbox never minted.
    #[error("unknown bearer token")]
    UnknownToken,
    /// The token's ServiceAccount does not exist (any more).
    #[error("serviceaccount {0} not found")]
    NoServiceAccount(String),
}

/// The bearer token of an `Authorization` header value, if it is one.
pub(crate) fn bearer(header: Option<&str>) -> Option<&str> {
    let value = header?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A new opaque token.
pub(crate) fn new_token() -> String {
    format!(
        "sandbox.{:016x}{:016x}",
        super::store::random_u64(),
        super::store::random_u64()
    )
}

/// A kubeconfig for `server` (trusting `ca_pem`) that sends `token` (context `sandbox`,
/// namespace `default`).
pub(crate) fn kubeconfig_text(server: &str, ca_pem: &str, user: &str, token: &str) -> String {
    use base64::Engine as _;
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: sandbox\n  cluster:\n    server: {server}\n\
         \x20   certificate-authority-data: {ca}\n\
         contexts:\n- name: sandbox\n  context:\n    cluster: sandbox\n    user: {user}\n    namespace: default\n\
         current-context: sandbox\nusers:\n- name: {user}\n  user:\n    token: {token}\npreferences: {{}}\n",
        user = quote(user),
        token = quote(token),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_account_identities_carry_upstream_groups_and_extras() {
        let sa = Identity::service_account("kube-system", "gpushare-device-plugin").on_node("n1");
        assert_eq!(
            sa.username,
            "system:serviceaccount:kube-system:gpushare-device-plugin"
        );
        assert_eq!(
            sa.groups,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:kube-system",
                "system:authenticated"
            ]
        );
        assert_eq!(
            sa.service_account_ref(),
            Some(("kube-system", "gpushare-device-plugin"))
        );
        assert_eq!(
            sa.user_info()["extra"][NODE_NAME_EXTRA],
            json!(["n1"]),
            "{}",
            sa.user_info()
        );
        assert_eq!(Identity::admin().service_account_ref(), None);
        assert!(Identity::admin().in_group(MASTERS));
        assert!(Identity::user("u", &[]).user_info().get("extra").is_none());
    }

    #[test]
    fn bearer_headers_parse() {
        assert_eq!(bearer(Some("Bearer abc")), Some("abc"));
        assert_eq!(bearer(Some("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(Some("Basic abc")), None);
        assert_eq!(bearer(Some("Bearer ")), None);
        assert_eq!(bearer(None), None);
        assert_ne!(new_token(), new_token());
    }
}
