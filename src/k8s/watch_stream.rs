//! A watch request and its answer read as it arrives: one event per line, each decoded through
//! the one JSON reader ([`super::decode`]), handed to [`super::watch::drive`] as kube's
//! `WatchEvent`s.
//!
//! It does what kube's `Api::watch` does (the same request, `Accept-Encoding: identity`, the
//! same errors: an answer of 4xx/5xx is the server's `Status`, a line that is not an event but
//! a `Status` is that error, a stream cut short ends quietly so that the driver reopens it)
//! with one difference that matters for the binary's size: kube decodes an event with serde's
//! adjacently tagged form, which keeps a second, buffered decoder of every watched object
//! (for an `object` sent before its `type`: half a megabyte of code for a Pod). Here an
//! `object` before its `type` is kept as raw JSON text and decoded once the type is known,
//! by the same reader as every other object; API servers send `type` first, so that detour
//! is never taken in practice.
//!
//! What it does not do: reopen, back off or track versions (the driver's).

use std::fmt;
use std::marker::PhantomData;

use bytes::BytesMut;
use futures::Stream;
use http_body_util::BodyExt as _;
use kube::Api;
use kube::api::{WatchEvent, WatchParams};
use kube::core::Status;
use kube::core::watch::Bookmark;
use serde::de::{self, DeserializeOwned, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Opens the watch of `api` from `version` under `params`: the server's refusal as kube reports
/// it, else the stream of its events (`None` once the server ends it or the connection is cut).
pub(crate) async fn open<K>(
    api: &Api<K>,
    params: &WatchParams,
    version: &str,
) -> Result<impl Stream<Item = Result<WatchEvent<K>, kube::Error>> + use<K>, kube::Error>
where
    K: kube::Resource + Clone + DeserializeOwned,
{
    let mut request = kube::core::Request::new(api.resource_url())
        .watch(params, version)
        .map_err(kube::Error::BuildRequest)?;
    // Watch answers are not compressed (kube asks the same: a gzip member per event is not
    // read past the first by its decompression layer).
    request.headers_mut().insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    request.extensions_mut().insert("watch");
    let client = api.clone().into_client();
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let status = response.status();
    let body = response.into_body();
    if status.is_client_error() || status.is_server_error() {
        let bytes = body.collect().await?.to_bytes();
        let text = String::from_utf8(bytes.to_vec()).map_err(kube::Error::FromUtf8)?;
        let refused = serde_json::from_str::<Status>(&text).unwrap_or_else(|_| {
            Status::failure(text.trim(), "Failed to parse error data").with_code(status.as_u16())
        });
        return Err(kube::Error::Api(refused.boxed()));
    }
    let lines = Lines {
        body,
        buf: BytesMut::new(),
        scanned: 0,
        ended: false,
    };
    Ok(futures::stream::unfold(lines, |mut lines| async move {
        let item = lines.next_event::<K>().await?;
        Some((item, lines))
    }))
}

/// The answer's body cut into lines.
struct Lines {
    body: kube::client::Body,
    buf: BytesMut,
    /// How much of `buf` holds no newline (not searched again).
    scanned: usize,
    ended: bool,
}

impl Lines {
    /// The next event, or error; `None` at the end of the stream.
    async fn next_event<K: DeserializeOwned>(
        &mut self,
    ) -> Option<Result<WatchEvent<K>, kube::Error>> {
        loop {
            let line = match self.next_line().await? {
                Ok(line) => line,
                Err(e) => return Some(Err(e)),
            };
            if let Some(event) = decode_line(&line) {
                return Some(event);
            }
        }
    }

    /// The next line without its `\n` (and `\r`); the rest of the body as the last line.
    async fn next_line(&mut self) -> Option<Result<BytesMut, kube::Error>> {
        loop {
            if let Some(at) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
                let mut line = self.buf.split_to(self.scanned + at + 1);
                self.scanned = 0;
                line.truncate(line.len() - 1);
                if line.last() == Some(&b'\r') {
                    line.truncate(line.len() - 1);
                }
                return Some(Ok(line));
            }
            self.scanned = self.buf.len();
            if self.ended {
                if self.buf.is_empty() {
                    return None;
                }
                self.scanned = 0;
                return Some(Ok(self.buf.split()));
            }
            match self.body.frame().await {
                None => self.ended = true,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                // A connection cut mid-stream (after minutes of watching, or a chunk ended
                // early): the stream ends and the driver reopens it, without an error.
                Some(Err(e)) if cut_short(&e) => {
                    tracing::warn!("eof in poll: {e:?}");
                    return None;
                }
                Some(Err(e)) => {
                    return Some(Err(kube::Error::ReadEvents(std::io::Error::other(e))));
                }
            }
        }
    }
}

/// Whether a body error is the connection ending early (an `UnexpectedEof` anywhere in its
/// chain, or hyper's chunk decoder saying so in words).
fn cut_short(e: &kube::Error) -> bool {
    if e.to_string().contains("unexpected EOF during chunk") {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::UnexpectedEof
        {
            return true;
        }
        source = err.source();
    }
    false
}

/// One line as an event: `None` for a line that is empty or cut short (nothing to report), a
/// `Status` line as that error, anything else that is not an event as a decode error.
fn decode_line<K: DeserializeOwned>(line: &[u8]) -> Option<Result<WatchEvent<K>, kube::Error>> {
    let text = match std::str::from_utf8(line) {
        Ok(text) => text,
        Err(e) => {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidData, e);
            return Some(Err(kube::Error::ReadEvents(e)));
        }
    };
    match serde_json::from_str::<Decoded<K>>(text) {
        Ok(Decoded(event)) => Some(Ok(event)),
        Err(e) if e.is_eof() => None,
        Err(e) => Some(Err(match serde_json::from_str::<Status>(text) {
            Ok(status) => kube::Error::Api(status.boxed()),
            Err(_) => kube::Error::SerdeError(e),
        })),
    }
}

/// A watch event as it is on the wire: `{"type": ..., "object": ...}`, keys in any order.
struct Decoded<K>(WatchEvent<K>);

/// The event types, as the API server spells them.
#[derive(Clone, Copy)]
enum Kind {
    Added,
    Modified,
    Deleted,
    Bookmark,
    Error,
}

impl Kind {
    fn parse<E: de::Error>(name: &str) -> Result<Kind, E> {
        Ok(match name {
            "ADDED" => Kind::Added,
            "MODIFIED" => Kind::Modified,
            "DELETED" => Kind::Deleted,
            "BOOKMARK" => Kind::Bookmark,
            "ERROR" => Kind::Error,
            other => return Err(E::unknown_variant(other, KINDS)),
        })
    }
}

const KINDS: &[&str] = &["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"];

/// The object of an event of `kind`, read from the map's next value.
fn object_of<'de, K: DeserializeOwned, A: MapAccess<'de>>(
    kind: Kind,
    map: &mut A,
) -> Result<WatchEvent<K>, A::Error> {
    Ok(match kind {
        Kind::Added => WatchEvent::Added(map.next_value()?),
        Kind::Modified => WatchEvent::Modified(map.next_value()?),
        Kind::Deleted => WatchEvent::Deleted(map.next_value()?),
        Kind::Bookmark => WatchEvent::Bookmark(map.next_value::<Bookmark>()?),
        Kind::Error => WatchEvent::Error(map.next_value::<Box<Status>>()?),
    })
}

/// The object of an event of `kind` from its raw text (an `object` sent before its `type`).
fn object_from_text<K: DeserializeOwned, E: de::Error>(
    kind: Kind,
    text: &str,
) -> Result<WatchEvent<K>, E> {
    let read = |e: serde_json::Error| E::custom(e);
    Ok(match kind {
        Kind::Added => WatchEvent::Added(serde_json::from_str(text).map_err(read)?),
        Kind::Modified => WatchEvent::Modified(serde_json::from_str(text).map_err(read)?),
        Kind::Deleted => WatchEvent::Deleted(serde_json::from_str(text).map_err(read)?),
        Kind::Bookmark => WatchEvent::Bookmark(serde_json::from_str(text).map_err(read)?),
        Kind::Error => WatchEvent::Error(serde_json::from_str(text).map_err(read)?),
    })
}

impl<'de, K: DeserializeOwned> serde::Deserialize<'de> for Decoded<K> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(EventVisitor(PhantomData))
    }
}

struct EventVisitor<K>(PhantomData<K>);

impl<'de, K: DeserializeOwned> Visitor<'de> for EventVisitor<K> {
    type Value = Decoded<K>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a watch event (type and object)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Decoded<K>, A::Error> {
        let mut kind: Option<Kind> = None;
        let mut early: Option<Box<RawValue>> = None;
        let mut event: Option<WatchEvent<K>> = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "type" => {
                    if kind.is_some() {
                        return Err(de::Error::duplicate_field("type"));
                    }
                    kind = Some(Kind::parse(
                        &map.next_value::<std::borrow::Cow<'de, str>>()?,
                    )?);
                }
                "object" => {
                    if event.is_some() || early.is_some() {
                        return Err(de::Error::duplicate_field("object"));
                    }
                    match kind {
                        Some(kind) => event = Some(object_of(kind, &mut map)?),
                        None => early = Some(map.next_value()?),
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
        match (event, early) {
            (Some(event), _) => Ok(Decoded(event)),
            (None, Some(raw)) => object_from_text(kind, raw.get()).map(Decoded),
            (None, None) => Err(de::Error::missing_field("object")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    const POD: &str = r#"{"metadata":{"name":"p","namespace":"ns","resourceVersion":"7"}}"#;

    fn event(line: &str) -> Option<Result<WatchEvent<Pod>, kube::Error>> {
        decode_line::<Pod>(line.as_bytes())
    }

    fn name(e: &WatchEvent<Pod>) -> Option<&str> {
        match e {
            WatchEvent::Added(p) | WatchEvent::Modified(p) | WatchEvent::Deleted(p) => {
                p.metadata.name.as_deref()
            }
            _ => None,
        }
    }

    /// Every event as kube's own decoding reads it, type first or object first.
    #[test]
    fn reads_every_event_as_kube_does() {
        for kind in ["ADDED", "MODIFIED", "DELETED"] {
            for line in [
                format!(r#"{{"type":"{kind}","object":{POD}}}"#),
                format!(r#"{{"object":{POD},"type":"{kind}"}}"#),
            ] {
                let ours = event(&line).expect("an event").expect("decoded");
                let kube: WatchEvent<Pod> = serde_json::from_str(&line).expect("kube decodes");
                assert_eq!(format!("{ours:?}"), format!("{kube:?}"), "{line}");
                assert_eq!(name(&ours), Some("p"), "{line}");
            }
        }
        let bookmark = r#"{"object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"42"}},"type":"BOOKMARK"}"#;
        match event(bookmark) {
            Some(Ok(WatchEvent::Bookmark(b))) => assert_eq!(b.metadata.resource_version, "42"),
            other => panic!("not a bookmark: {other:?}"),
        }
        let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","message":"too old","reason":"Expired","code":410}}"#;
        match event(gone) {
            Some(Ok(WatchEvent::Error(s))) => {
                assert_eq!((s.code, s.reason.as_str()), (410, "Expired"))
            }
            other => panic!("not an error event: {other:?}"),
        }
    }

    #[test]
    fn lines_that_are_not_events() {
        // Empty or cut short: nothing to report.
        assert!(event("").is_none());
        assert!(event(r#"{"type":"ADDED","object":{"metadata":"#).is_none());
        // A Status line is the API's error.
        let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"no","reason":"Forbidden","code":403}"#;
        match event(status) {
            Some(Err(kube::Error::Api(s))) => assert_eq!(s.code, 403),
            other => panic!("not the API's error: {other:?}"),
        }
        // Not an event: the same error as kube's own decoding gives (its fallback reads a
        // Status from any object, so an object that is no event is the API's error).
        for bad in [
            "[1]",
            r#"{"type":"RENAMED","object":{}}"#,
            r#"{"type":"ADDED"}"#,
            r#"{"object":{}}"#,
            r#"{"type":"ADDED","object":{"metadata":{"name":3}}}"#,
        ] {
            assert!(
                serde_json::from_str::<WatchEvent<Pod>>(bad).is_err(),
                "kube refuses {bad}"
            );
            let kube_api = serde_json::from_str::<Status>(bad).is_ok();
            match event(bad) {
                Some(Err(kube::Error::Api(_))) if kube_api => {}
                Some(Err(kube::Error::SerdeError(_))) if !kube_api => {}
                other => panic!("{bad}: {other:?}, kube reads a Status: {kube_api}"),
            }
        }
        assert!(matches!(
            decode_line::<Pod>(b"{\"type\":\"ADDED\",\"object\":{\"x\":\"\xff\"}}"),
            Some(Err(kube::Error::ReadEvents(_)))
        ));
    }
}
