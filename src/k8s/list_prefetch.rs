//! Paged lists fetched one page ahead: a tower layer under the kube client that, when a page of
//! a `GET …?limit=N` list arrives with a `continue` token, asks for the next page at once, so
//! the API server serves page n+1 while the caller (kube-runtime's watcher) decodes page n.
//!
//! Why: the watcher fetches pages strictly in turn, so a full list costs the server's time
//! plus ours, page after page; a new leader's rebuild and a cold start are exactly such lists
//! (150,000 pods: 300 pages). A paged list is one consistent snapshot (the continue token pins
//! the resourceVersion of its first page), so asking for a page a moment earlier returns the
//! same answer as asking when the watcher gets to it.
//!
//! What it does not do: change any request or answer. A page it fetched ahead is handed over
//! only to a request for exactly that page (same path, same query, parameters compared
//! decoded and in any order); anything else goes to the API server as before. A page fetched
//! ahead that fails is asked for again, and one nobody asks for (the list was abandoned) is
//! dropped after [`KEEP`] or when more than [`MAX_AHEAD`] wait. Watches and every other
//! request pass through untouched, streaming.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::BodyExt as _;
use kube::client::Body;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use tokio::task::JoinHandle;
use tower::{Layer, Service, ServiceExt as _};

/// An error of the service stack, as kube's client carries it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of kube's service stack (its `DynBody`, boxed).
pub type BoxBody = Box<dyn hyper::body::Body<Data = Bytes, Error = BoxError> + Send + Unpin>;

/// How long a page fetched ahead waits for its request before it is dropped.
pub const KEEP: Duration = Duration::from_secs(60);
/// How many pages fetched ahead may wait at once (one per list in progress is the norm).
pub const MAX_AHEAD: usize = 16;

/// The layer: wraps kube's service stack (made cloneable by a `tower::buffer::Buffer`).
#[derive(Clone, Debug, Default)]
pub struct ListPrefetchLayer;

impl<S> Layer<S> for ListPrefetchLayer {
    type Service = ListPrefetch<S>;

    fn layer(&self, inner: S) -> ListPrefetch<S> {
        ListPrefetch {
            inner,
            ahead: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// A page as it came back: status, headers and the whole body.
type Page = (http::response::Parts, Bytes);

/// Pages fetched ahead, by the request that will ask for them.
type Ahead = HashMap<PageKey, (Instant, JoinHandle<Result<Page, BoxError>>)>;

/// The service: see the module docs.
#[derive(Clone)]
pub struct ListPrefetch<S> {
    inner: S,
    ahead: Arc<Mutex<Ahead>>,
}

impl<S> std::fmt::Debug for ListPrefetch<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListPrefetch").finish_non_exhaustive()
    }
}

impl<S, B> Service<Request<Body>> for ListPrefetch<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<BoxBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let Some(key) = PageKey::of_list_page(&req) else {
            // Not a paged list (a watch, a write, a single GET): untouched, streaming.
            let fut = self.inner.call(req);
            return Box::pin(async move {
                let resp = fut.await.map_err(Into::into)?;
                Ok(resp.map(|b| Box::new(b.map_err(Into::into)) as BoxBody))
            });
        };
        let inner = self.inner.clone();
        let ahead = self.ahead.clone();
        let fetch: Pin<Box<dyn Future<Output = Result<Page, BoxError>> + Send>> =
            match take(&self.ahead, &key) {
                // `call` would send the request at once: only when no page waits.
                None => Box::pin(collect(self.inner.call(clone_head(&req)))),
                Some(task) => {
                    let again = clone_head(&req);
                    let inner = self.inner.clone();
                    Box::pin(async move {
                        match task.await {
                            Ok(Ok(page)) => Ok(page),
                            // The page fetched ahead failed or its task died: ask again, as
                            // the caller did.
                            _ => collect(inner.oneshot(again)).await,
                        }
                    })
                }
            };
        Box::pin(async move {
            let page = fetch.await?;
            if page.0.status == http::StatusCode::OK
                && let Some(token) = continue_token(&page.1)
            {
                fetch_ahead(&ahead, inner, key.next(&req, &token));
            }
            let (parts, body) = page;
            Ok(Response::from_parts(parts, full(body)))
        })
    }
}

/// Sends `req` and reads the whole answer.
async fn collect<F, B, E>(fut: F) -> Result<Page, BoxError>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let resp = fut.await.map_err(Into::into)?;
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
    Ok((parts, bytes))
}

/// A body of `bytes`, boxed as kube's stack expects.
fn full(bytes: Bytes) -> BoxBody {
    Box::new(http_body_util::Full::new(bytes).map_err(|never| match never {}))
}

/// The method, URI, version and headers of `req`, with an empty body (a list is a GET).
fn clone_head(req: &Request<Body>) -> Request<Body> {
    let mut out = Request::new(Body::empty());
    *out.method_mut() = req.method().clone();
    *out.uri_mut() = req.uri().clone();
    *out.version_mut() = req.version();
    *out.headers_mut() = req.headers().clone();
    out
}

/// Takes the page fetched ahead for `key`, if any.
fn take(ahead: &Mutex<Ahead>, key: &PageKey) -> Option<JoinHandle<Result<Page, BoxError>>> {
    let mut ahead = ahead.lock().unwrap_or_else(|p| p.into_inner());
    ahead.remove(key).map(|(_, task)| task)
}

/// Starts fetching `next` (its key and request) in a task of its own.
fn fetch_ahead<S, B>(ahead: &Mutex<Ahead>, inner: S, next: (PageKey, Request<Body>))
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (key, req) = next;
    let task = tokio::spawn(async move { collect(inner.oneshot(req)).await });
    let now = Instant::now();
    let mut ahead = ahead.lock().unwrap_or_else(|p| p.into_inner());
    ahead.retain(|_, (at, task)| {
        let keep = now.duration_since(*at) < KEEP;
        if !keep {
            task.abort();
        }
        keep
    });
    while ahead.len() >= MAX_AHEAD {
        let Some(oldest) = ahead
            .iter()
            .min_by_key(|(_, (at, _))| *at)
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        if let Some((_, task)) = ahead.remove(&oldest) {
            task.abort();
        }
    }
    if let Some((_, old)) = ahead.insert(key, (now, task)) {
        old.abort();
    }
}

/// Which page of which list a request asks for: the path and the decoded query parameters,
/// sorted (so the order kube writes them in does not matter).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PageKey {
    path: String,
    params: Vec<(String, String)>,
}

impl PageKey {
    /// The key of `req` if it is a page of a paged list: a GET with `limit`, not a watch.
    pub fn of_list_page<T>(req: &Request<T>) -> Option<PageKey> {
        if req.method() != Method::GET {
            return None;
        }
        let query = req.uri().query()?;
        let mut params: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let value = |name: &str| {
            params
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        if value("limit").is_none_or(|l| l.is_empty() || l == "0") {
            return None;
        }
        if value("watch").is_some_and(|w| w == "true" || w == "1") {
            return None;
        }
        params.sort();
        Some(PageKey {
            path: req.uri().path().to_string(),
            params,
        })
    }

    /// The key and the request of the page after this one: `req` with `continue=token`.
    fn next(&self, req: &Request<Body>, token: &str) -> (PageKey, Request<Body>) {
        let mut params: Vec<(String, String)> = self
            .params
            .iter()
            .filter(|(k, _)| k != "continue")
            .cloned()
            .collect();
        params.push(("continue".to_string(), token.to_string()));
        let query: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(params.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .finish();
        let mut next = clone_head(req);
        let uri = format!("{}?{query}", self.path);
        if let Ok(uri) = uri.parse() {
            *next.uri_mut() = uri;
        }
        params.sort();
        (
            PageKey {
                path: self.path.clone(),
                params,
            },
            next,
        )
    }
}

/// `metadata.continue` of a list answer, if not empty. Reads only as far as it must: the API
/// server writes `metadata` before `items`, and reading stops at `items`.
pub fn continue_token(body: &[u8]) -> Option<String> {
    let mut found = None;
    let mut de = serde_json::Deserializer::from_slice(body);
    // Stopping at `items` ends the parse with an error on purpose; what was found stands.
    let _ = ListHead { found: &mut found }.deserialize(&mut de);
    found.filter(|t| !t.is_empty())
}

/// Reads a list answer's top-level keys up to `items`, keeping `metadata.continue`.
struct ListHead<'a> {
    found: &'a mut Option<String>,
}

/// The marker error that stops the parse at `items`.
const STOP: &str = "stop at items";

impl<'de> DeserializeSeed<'de> for ListHead<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ListHead<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list answer")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "metadata" => {
                    let meta: ListMeta = map.next_value()?;
                    *self.found = meta.continue_token;
                    return Err(de::Error::custom(STOP));
                }
                "items" if self.found.is_some() => return Err(de::Error::custom(STOP)),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// The part of a list's `metadata` read here.
#[derive(serde::Deserialize)]
struct ListMeta {
    #[serde(rename = "continue", default)]
    continue_token: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).expect("request")
    }

    #[test]
    fn the_continue_token_is_read_from_the_metadata_before_the_items() {
        let body = br#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"9","continue":"eyJ2Ijoi+/="},"items":[{"metadata":{"name":"a"}}, not even json"#;
        assert_eq!(continue_token(body).as_deref(), Some("eyJ2Ijoi+/="));
    }

    #[test]
    fn a_token_after_the_items_is_found_too_and_an_empty_one_is_none() {
        let body = br#"{"items":[{"metadata":{"continue":"no"}}],"metadata":{"continue":"late"}}"#;
        assert_eq!(continue_token(body).as_deref(), Some("late"));
        assert_eq!(
            continue_token(br#"{"metadata":{"continue":""},"items":[]}"#),
            None
        );
        assert_eq!(
            continue_token(br#"{"metadata":{"resourceVersion":"1"},"items":[]}"#),
            None
        );
        assert_eq!(continue_token(b"garbage"), None);
        assert_eq!(continue_token(b""), None);
    }

    #[test]
    fn only_gets_of_paged_lists_are_pages() {
        assert!(PageKey::of_list_page(&get("/api/v1/pods?&limit=500")).is_some());
        assert!(PageKey::of_list_page(&get("/api/v1/pods")).is_none());
        assert!(PageKey::of_list_page(&get("/api/v1/pods?limit=0")).is_none());
        assert!(
            PageKey::of_list_page(&get("/api/v1/pods?watch=true&limit=500")).is_none(),
            "a watch"
        );
        let post = Request::post("/api/v1/pods?limit=5")
            .body(Body::empty())
            .expect("request");
        assert!(PageKey::of_list_page(&post).is_none());
    }

    #[test]
    fn the_next_page_is_the_same_list_with_the_token_whatever_the_parameter_order() {
        let first = get("/api/v1/pods?&fieldSelector=spec.nodeName%3Dn1&limit=500");
        let key = PageKey::of_list_page(&first).expect("a page");
        let (next_key, next) = key.next(&first, "a+b/c=");
        // What kube-runtime's watcher asks for next, in its own parameter order.
        let asked =
            get("/api/v1/pods?&limit=500&fieldSelector=spec.nodeName%3Dn1&continue=a%2Bb%2Fc%3D");
        assert_eq!(PageKey::of_list_page(&asked), Some(next_key.clone()));
        assert_eq!(PageKey::of_list_page(&next), Some(next_key));
        // Another list (another selector) is not that page.
        let other = get("/api/v1/pods?&limit=500&continue=a%2Bb%2Fc%3D");
        assert_ne!(PageKey::of_list_page(&other), PageKey::of_list_page(&asked));
    }
}
