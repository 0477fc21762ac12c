//! The one way the kubelet APIs are served on a unix socket (the device plugin's socket, the
//! sandbox kubelet's): tonic over a listener whose connections accept every `:authority` a
//! real client sends.
//!
//! kubelet 1.11-1.25 dials plugin sockets with grpc-go and a bare path, so the socket path
//! (`/var/lib/kubelet/device-plugins/aliyungpushare.sock`) travels as the HTTP/2 `:authority`;
//! Python grpcio and grpc-java do the same. That is not a valid URI authority, and h2 (under
//! tonic) answers such a request with `RST_STREAM PROTOCOL_ERROR`, with no switch to relax
//! it. kubelet 1.26+ sends `localhost`, which h2 accepts.
//!
//! [`AuthorityRepair`] wraps each accepted connection and sits between the client and h2 on
//! the read side only: it passes the connection preface and every frame through unchanged,
//! except header blocks (HEADERS + CONTINUATION), which it decodes with an HPACK decoder that
//! mirrors the client's dynamic table, and re-encodes for h2 with literal fields only (so h2's
//! own table stays empty and the two never disagree). An `:authority` that is not a valid URI
//! authority becomes `localhost` (what kubelet 1.26+ sends); every other field, valid
//! authorities included, is forwarded as decoded. Padding is dropped; priority is kept.
//!
//! A connection whose first header block needs no repair (kubelet 1.26+, tonic: a valid
//! `:authority`) is forwarded byte for byte from that block on, the block included: h2 then
//! decodes every block itself, with the client's own dynamic table, and the connection costs
//! no HPACK work here (the hot path of every Allocate from a current kubelet). A client sends
//! one `:authority` per connection (the target it dialled), so a connection that starts
//! valid stays valid.
//!
//! What it does not do: judge the protocol. Input it cannot parse as HTTP/2 (no preface, a
//! header block that does not decode, CONTINUATION out of place, a header block over
//! [`MAX_HEADER_BLOCK`]) is forwarded from there on byte for byte, so h2 sees what the client
//! sent and answers as it always does (GOAWAY). The write side is untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Size of a frame header.
const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload we emit: the smallest SETTINGS_MAX_FRAME_SIZE a peer may have, so
/// it is always allowed.
const MAX_EMITTED_FRAME: usize = 16_384;
/// Largest header block (all its frames) we buffer; past it the connection is forwarded raw
/// and h2 applies its own, smaller, header list limit.
pub const MAX_HEADER_BLOCK: usize = 1024 * 1024;
/// HPACK dynamic table size h2 advertises (the protocol default; tonic does not change it).
const HPACK_TABLE_SIZE: usize = 4096;
/// What an invalid `:authority` becomes: what kubelet 1.26+ sends.
pub const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// The connections of `listener`, each wrapped in [`AuthorityRepair`], for tonic's
/// `serve_with_incoming*`.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityRepair<UnixStream>>> {
    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityRepair::new))
}

/// Where the reader is in the client's byte stream.
#[derive(Debug)]
enum Stage {
    /// Waiting for the 24-byte connection preface.
    Preface,
    /// Between frames, or forwarding the payload of a frame that is not a header block.
    Frames { forward: usize },
    /// Forwarding everything unchanged (input we do not understand; h2 will judge it).
    Raw,
}

/// A header block being collected: HEADERS and the CONTINUATIONs that follow it.
#[derive(Debug)]
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames exactly as received, forwarded if the block cannot be handled.
    raw: Vec<u8>,
}

/// A connection whose header blocks reach h2 with every `:authority` h2 accepts (module docs).
pub struct AuthorityRepair<S> {
    io: S,
    /// Received from the client, not yet processed.
    input: BytesMut,
    /// Processed, ready for h2.
    output: BytesMut,
    stage: Stage,
    block: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
    eof: bool,
    /// How many `:authority` values were replaced on this connection.
    replaced: u64,
    /// Whether a header block was emitted re-encoded (then h2's dynamic table is not the
    /// client's, and every later block must be re-encoded too).
    reencoded: bool,
}

impl<S> std::fmt::Debug for AuthorityRepair<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorityRepair")
            .field("stage", &self.stage)
            .field("replaced", &self.replaced)
            .finish_non_exhaustive()
    }
}

impl<S> AuthorityRepair<S> {
    /// Wraps a freshly accepted connection (nothing read from it yet).
    pub fn new(io: S) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HPACK_TABLE_SIZE);
        AuthorityRepair {
            io,
            input: BytesMut::with_capacity(8192),
            output: BytesMut::with_capacity(8192),
            stage: Stage::Preface,
            block: None,
            decoder,
            eof: false,
            replaced: 0,
            reencoded: false,
        }
    }

    /// How many `:authority` values were replaced on this connection so far.
    pub fn replaced(&self) -> u64 {
        self.replaced
    }

    /// Moves what can be moved from `input` to `output`.
    fn process(&mut self) {
        loop {
            match self.stage {
                Stage::Raw => {
                    let all = self.input.split();
                    self.output.extend_from_slice(&all);
                    return;
                }
                Stage::Preface => {
                    let n = self.input.len().min(PREFACE.len());
                    if self.input[..n] != PREFACE[..n] {
                        self.stage = Stage::Raw;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return;
                    }
                    let preface = self.input.split_to(PREFACE.len());
                    self.output.extend_from_slice(&preface);
                    self.stage = Stage::Frames { forward: 0 };
                }
                Stage::Frames { forward } if forward > 0 => {
                    let n = forward.min(self.input.len());
                    if n == 0 {
                        return;
                    }
                    let bytes = self.input.split_to(n);
                    self.output.extend_from_slice(&bytes);
                    self.stage = Stage::Frames {
                        forward: forward - n,
                    };
                }
                Stage::Frames { .. } => {
                    if self.input.len() < FRAME_HEADER {
                        return;
                    }
                    if !self.frame() {
                        return;
                    }
                }
            }
        }
    }

    /// Handles the frame at the start of `input`; false when more input is needed.
    fn frame(&mut self) -> bool {
        let h = &self.input[..FRAME_HEADER];
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let kind = h[3];
        let flags = h[4];
        let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let in_block = self.block.as_ref().map(|b| b.stream_id);
        let header_frame = match (kind, in_block) {
            (TYPE_HEADERS, None) => true,
            (TYPE_CONTINUATION, Some(id)) if id == stream_id => true,
            // A CONTINUATION with no block open is h2's to refuse; anything but the block's
            // CONTINUATION while a block is open is a protocol error h2 must see.
            (_, Some(_)) => {
                self.give_up();
                return true;
            }
            _ => false,
        };
        if !header_frame {
            let header = self.input.split_to(FRAME_HEADER);
            self.output.extend_from_slice(&header);
            self.stage = Stage::Frames { forward: len };
            return true;
        }
        let collected = self.block.as_ref().map_or(0, |b| b.raw.len());
        if collected + FRAME_HEADER + len > MAX_HEADER_BLOCK {
            self.give_up();
            return true;
        }
        if self.input.len() < FRAME_HEADER + len {
            return false;
        }
        let frame = self.input.split_to(FRAME_HEADER + len);
        let payload = &frame[FRAME_HEADER..];
        if kind == TYPE_HEADERS {
            let Some((priority, fragment)) = headers_payload(flags, payload) else {
                // Padding longer than the frame: forward it for h2 to refuse.
                self.output.extend_from_slice(&frame);
                self.stage = Stage::Raw;
                return true;
            };
            self.block = Some(PendingBlock {
                stream_id,
                end_stream: flags & FLAG_END_STREAM != 0,
                priority,
                fragment: fragment.to_vec(),
                raw: frame.to_vec(),
            });
        } else if let Some(block) = self.block.as_mut() {
            block.fragment.extend_from_slice(payload);
            block.raw.extend_from_slice(&frame);
        }
        if flags & FLAG_END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.finish(block);
        }
        true
    }

    /// Decodes a complete header block and emits it re-encoded, or raw when it does not decode.
    fn finish(&mut self, block: PendingBlock) {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let decoded = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            fields.push((name.into_owned(), value.into_owned()));
        });
        if let Err(e) = decoded {
            tracing::debug!(error = ?e, "gRPC: a header block does not decode; forwarding the connection as it is");
            self.output.extend_from_slice(&block.raw);
            self.stage = Stage::Raw;
            return;
        }
        let needs_repair = fields
            .iter()
            .any(|(name, value)| name.as_slice() == b":authority" && !valid_authority(value));
        if !needs_repair && !self.reencoded {
            // Nothing to repair, and h2 has seen nothing re-encoded: the client's own bytes,
            // and the connection from here on unchanged (module docs).
            self.output.extend_from_slice(&block.raw);
            self.stage = Stage::Raw;
            return;
        }
        self.reencoded = true;
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        for (name, value) in &fields {
            let value: &[u8] = if name.as_slice() == b":authority" && !valid_authority(value) {
                self.replaced += 1;
                tracing::debug!(
                    authority = %String::from_utf8_lossy(value),
                    "gRPC: a client sent a socket path as :authority (kubelet <= 1.25, grpcio, grpc-java); serving it as localhost"
                );
                REPLACEMENT_AUTHORITY
            } else {
                value
            };
            encode_literal(&mut encoded, name, value);
        }
        emit_header_frames(&mut self.output, &block, &encoded);
    }

    /// Forwards the open block (if any) and everything after it unchanged.
    fn give_up(&mut self) {
        if let Some(block) = self.block.take() {
            self.output.extend_from_slice(&block.raw);
        }
        self.stage = Stage::Raw;
    }
}

/// True when h2 accepts `value` as `:authority`.
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// The priority bytes and the header block fragment of a HEADERS payload; `None` when the
/// padding does not fit.
fn headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut rest = payload;
    let mut pad = 0usize;
    if flags & FLAG_PADDED != 0 {
        let (&len, tail) = rest.split_first()?;
        pad = usize::from(len);
        rest = tail;
    }
    let priority = if flags & FLAG_PRIORITY != 0 {
        let (p, tail) = rest.split_first_chunk::<5>()?;
        rest = tail;
        Some(*p)
    } else {
        None
    };
    let end = rest.len().checked_sub(pad)?;
    Some((priority, &rest[..end]))
}

/// An HPACK integer with an `n`-bit prefix whose high bits are `first` (RFC 7541 §5.1).
fn encode_integer(out: &mut Vec<u8>, first: u8, n: u32, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        // Fits the prefix: value < 2^n <= 128.
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A "literal header field without indexing — new name" with raw (not Huffman) strings.
fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    encode_integer(out, 0x00, 7, name.len());
    out.extend_from_slice(name);
    encode_integer(out, 0x00, 7, value.len());
    out.extend_from_slice(value);
}

/// The block as HEADERS (+ CONTINUATION) frames of at most [`MAX_EMITTED_FRAME`] bytes.
fn emit_header_frames(out: &mut BytesMut, block: &PendingBlock, encoded: &[u8]) {
    let priority_len = if block.priority.is_some() { 5 } else { 0 };
    let first_len = encoded.len().min(MAX_EMITTED_FRAME - priority_len);
    let (first, mut rest) = encoded.split_at(first_len);
    let mut flags = 0u8;
    if block.end_stream {
        flags |= FLAG_END_STREAM;
    }
    if let Some(p) = block.priority {
        flags |= FLAG_PRIORITY;
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        put_frame_header(
            out,
            priority_len + first.len(),
            TYPE_HEADERS,
            flags,
            block.stream_id,
        );
        out.put_slice(&p);
    } else {
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        put_frame_header(out, first.len(), TYPE_HEADERS, flags, block.stream_id);
    }
    out.put_slice(first);
    while !rest.is_empty() {
        let n = rest.len().min(MAX_EMITTED_FRAME);
        let (chunk, tail) = rest.split_at(n);
        let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
        put_frame_header(out, n, TYPE_CONTINUATION, flags, block.stream_id);
        out.put_slice(chunk);
        rest = tail;
    }
}

fn put_frame_header(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream_id: u32) {
    // len <= MAX_EMITTED_FRAME, well inside 24 bits.
    out.put_uint(len as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream_id & 0x7fff_ffff);
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRepair<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // A truncated frame or block at the end: hand h2 what the client sent.
                this.give_up();
                this.process();
                if this.output.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        this.eof = true;
                    } else {
                        this.input.extend_from_slice(read.filled());
                        this.process();
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRepair<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityRepair<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    const SOCKET: &[u8] = b"/var/lib/kubelet/device-plugins/aliyungpushare.sock";

    /// A reader handing out `step` bytes per poll.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self
                .step
                .min(self.data.len() - self.at)
                .min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.data[at..at + n]);
            self.at += n;
            Poll::Ready(Ok(()))
        }
    }

    async fn through(data: &[u8], step: usize) -> (Vec<u8>, u64) {
        let mut conn = AuthorityRepair::new(Trickle {
            data: data.to_vec(),
            at: 0,
            step,
        });
        let mut out = Vec::new();
        conn.read_to_end(&mut out).await.expect("reads");
        (out, conn.replaced())
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        put_frame_header(&mut out, payload.len(), kind, flags, stream);
        out.put_slice(payload);
        out.to_vec()
    }

    fn request_headers(authority: &[u8]) -> Vec<(&'static [u8], Vec<u8>)> {
        vec![
            (b":method", b"POST".to_vec()),
            (b":scheme", b"http".to_vec()),
            (b":path", b"/v1beta1.DevicePlugin/Allocate".to_vec()),
            (b":authority", authority.to_vec()),
            (b"content-type", b"application/grpc".to_vec()),
            (b"te", b"trailers".to_vec()),
        ]
    }

    /// Parses frames; returns (kind, flags, stream, payload) of each, after the preface.
    fn frames(mut data: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(data.starts_with(PREFACE), "the preface comes first");
        data = &data[PREFACE.len()..];
        let mut out = Vec::new();
        while !data.is_empty() {
            let len =
                (usize::from(data[0]) << 16) | (usize::from(data[1]) << 8) | usize::from(data[2]);
            let stream = u32::from_be_bytes([data[5], data[6], data[7], data[8]]);
            out.push((data[3], data[4], stream, data[9..9 + len].to_vec()));
            data = &data[9 + len..];
        }
        out
    }

    /// Decodes every header block of `data` the way h2 does (one decoder for the connection).
    fn header_blocks(data: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut decoder = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut fragment = Vec::new();
        for (kind, flags, _, payload) in frames(data) {
            if kind == TYPE_HEADERS {
                let (_, f) = headers_payload(flags, &payload).expect("valid");
                fragment = f.to_vec();
            } else if kind == TYPE_CONTINUATION {
                fragment.extend_from_slice(&payload);
            } else {
                continue;
            }
            if flags & FLAG_END_HEADERS != 0 {
                blocks.push(decoder.decode(&fragment).expect("the block decodes"));
            }
        }
        blocks
    }

    fn value<'a>(block: &'a [(Vec<u8>, Vec<u8>)], name: &[u8]) -> Option<&'a [u8]> {
        block
            .iter()
            .find(|(n, _)| n.as_slice() == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Two requests from an encoder that indexes (the second references the client's dynamic
    /// table for the path authority), a DATA frame between them, read 1, 7 and 8192 bytes at a time.
    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_in_every_request() {
        let mut encoder = loona_hpack::Encoder::new();
        let headers = request_headers(SOCKET);
        let block = |enc: &mut loona_hpack::Encoder| {
            enc.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())))
        };
        let first = block(&mut encoder);
        let second = block(&mut encoder);
        assert!(
            second.len() < first.len(),
            "the second request uses the dynamic table"
        );
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &first));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\x05hello"));
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            3,
            &second,
        ));
        for step in [1, 7, 8192] {
            let (out, replaced) = through(&input, step).await;
            assert_eq!(replaced, 2, "step {step}");
            let blocks = header_blocks(&out);
            assert_eq!(blocks.len(), 2);
            for b in &blocks {
                assert_eq!(value(b, b":authority"), Some(REPLACEMENT_AUTHORITY));
                assert_eq!(
                    value(b, b":path"),
                    Some(&b"/v1beta1.DevicePlugin/Allocate"[..])
                );
                assert_eq!(b.len(), 6, "every field is kept");
            }
            let f = frames(&out);
            assert_eq!(f[0].0, 0x4, "SETTINGS passes");
            assert_eq!(
                f[2],
                (0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\x05hello".to_vec())
            );
            assert_eq!(
                f[3].1,
                FLAG_END_HEADERS | FLAG_END_STREAM,
                "END_STREAM is kept"
            );
        }
    }

    #[tokio::test]
    async fn padding_priority_and_continuation_of_a_repaired_block() {
        let mut encoder = loona_hpack::Encoder::new();
        let headers = request_headers(SOCKET);
        let block = encoder.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())));
        let (a, b) = block.split_at(block.len() / 2);
        let mut payload = vec![3u8]; // pad length
        payload.extend_from_slice(&[0x80, 0, 0, 1, 16]); // priority: exclusive, dep 1, weight 16
        payload.extend_from_slice(a);
        payload.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY,
            5,
            &payload,
        ));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let (out, replaced) = through(&input, 3).await;
        assert_eq!(replaced, 1);
        let blocks = header_blocks(&out);
        assert_eq!(
            value(&blocks[0], b":authority"),
            Some(REPLACEMENT_AUTHORITY)
        );
        let f = frames(&out);
        assert_eq!(f.len(), 1, "one HEADERS frame");
        assert_eq!(
            f[0].1,
            FLAG_PRIORITY | FLAG_END_HEADERS,
            "padding dropped, priority kept"
        );
        assert_eq!(&f[0].3[..5], &[0x80, 0, 0, 1, 16]);
    }

    /// A connection whose first block has a valid `:authority` (padding, priority and a
    /// CONTINUATION included) passes byte for byte, that block and every frame after it.
    #[tokio::test]
    async fn a_connection_that_starts_with_a_valid_authority_passes_unchanged() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        for stream in [1u32, 3] {
            let headers = request_headers(b"localhost");
            let block = encoder.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())));
            let (a, b) = block.split_at(block.len() / 2);
            let mut payload = vec![3u8]; // pad length
            payload.extend_from_slice(&[0x80, 0, 0, 1, 16]); // priority
            payload.extend_from_slice(a);
            payload.extend_from_slice(&[0, 0, 0]);
            input.extend(frame(
                TYPE_HEADERS,
                FLAG_PADDED | FLAG_PRIORITY,
                stream,
                &payload,
            ));
            input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, stream, b));
            input.extend(frame(0x0, FLAG_END_STREAM, stream, b"\0\0\0\0\0"));
        }
        for step in [1, 3, 7, input.len()] {
            let (out, replaced) = through(&input, step).await;
            assert_eq!(replaced, 0, "step {step}");
            assert_eq!(out, input, "step {step}: forwarded unchanged");
        }
    }

    /// Once a block was re-encoded, every later block is re-encoded too, valid or not: h2's
    /// dynamic table is no longer the client's.
    #[tokio::test]
    async fn after_a_repaired_block_valid_ones_are_reencoded_too() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        for (stream, authority) in [(1u32, SOCKET), (3, &b"localhost"[..])] {
            let headers = request_headers(authority);
            let block = encoder.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())));
            input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, stream, &block));
        }
        let (out, replaced) = through(&input, 5).await;
        assert_eq!(replaced, 1);
        let blocks = header_blocks(&out);
        assert_eq!(blocks.len(), 2);
        for b in &blocks {
            assert_eq!(value(b, b":authority"), Some(&b"localhost"[..]));
            assert_eq!(
                value(b, b":path"),
                Some(&b"/v1beta1.DevicePlugin/Allocate"[..])
            );
        }
    }

    #[tokio::test]
    async fn a_block_larger_than_one_frame_is_split_into_continuations() {
        let big = vec![b'x'; 40_000];
        let mut encoder = loona_hpack::Encoder::new();
        let block = encoder.encode([(&b":authority"[..], SOCKET), (&b"x-big"[..], &big[..])]);
        let mut input = PREFACE.to_vec();
        // The client's own frames may be up to the peer's max frame size; send one big one.
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        let (out, replaced) = through(&input, 8192).await;
        assert_eq!(replaced, 1);
        let f = frames(&out);
        assert!(f.len() >= 3, "{} frames", f.len());
        assert!(f.iter().all(|x| x.3.len() <= MAX_EMITTED_FRAME));
        assert_eq!(f[0].0, TYPE_HEADERS);
        assert!(f[1..].iter().all(|x| x.0 == TYPE_CONTINUATION && x.2 == 1));
        let blocks = header_blocks(&out);
        assert_eq!(value(&blocks[0], b"x-big"), Some(&big[..]));
    }

    /// What we cannot parse reaches h2 byte for byte: a broken HPACK block, a stream that is
    /// not HTTP/2, a frame interleaved into a header block, a truncated frame.
    #[tokio::test]
    async fn input_it_does_not_understand_passes_unchanged() {
        let mut broken = PREFACE.to_vec();
        broken.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0xff],
        ));
        broken.extend(frame(0x0, 0, 1, b"after"));
        let not_h2 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        let mut interleaved = PREFACE.to_vec();
        interleaved.extend(frame(TYPE_HEADERS, 0, 1, &[0x82]));
        interleaved.extend(frame(0x6, 0, 0, &[0; 8])); // PING inside a header block
        interleaved.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x84]));
        let mut truncated = PREFACE.to_vec();
        truncated.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &[0x82, 0x84, 0x86],
        ));
        truncated.truncate(truncated.len() - 1);
        let mut bad_padding = PREFACE.to_vec();
        bad_padding.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_PADDED,
            1,
            &[9, 0x82],
        ));
        for input in [broken, not_h2, interleaved, truncated, bad_padding] {
            for step in [1, 8192] {
                let (out, _) = through(&input, step).await;
                assert_eq!(out, input);
            }
        }
    }

    #[test]
    fn integers_follow_rfc7541_c1() {
        let mut out = Vec::new();
        encode_integer(&mut out, 0, 5, 10);
        assert_eq!(out, [10]);
        out.clear();
        encode_integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [31, 154, 10]);
        out.clear();
        encode_integer(&mut out, 0, 7, 127);
        assert_eq!(out, [127, 0]);
    }

    #[test]
    fn authorities_h2_refuses_are_the_ones_replaced() {
        assert!(!valid_authority(SOCKET));
        assert!(!valid_authority(b""));
        assert!(valid_authority(b"localhost"));
        // Some grpc-go versions percent-encode the path; h2 refuses that too.
        assert!(!valid_authority(b"%2Fvar%2Flib%2Fkubelet.sock"));
        assert!(valid_authority(b"[::1]:1"));
    }
}
