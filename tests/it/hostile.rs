//! Hostile input against the extender, bounded in count and time, on loopback only:
//! random and malformed JSON (decoders directly, and over HTTP), slow-loris headers, huge
//! bodies, and thousands of connections. The extender must answer 4xx (or bind's documented
//! 500), never panic, never stop answering others, and keep its memory bounded.

use std::time::Duration;

use gpushare::extender::wire::{decode_binding_args, decode_extender_args};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::extender_cluster::{extender_config, sandbox, start_extender};
use crate::support::extender_http::http;

/// Arbitrary JSON, biased towards the extender's own keys in every letter case.
fn json_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("Pod".to_string()),
        Just("pod".to_string()),
        Just("NODENAMES".to_string()),
        Just("NodeNames".to_string()),
        Just("nodes".to_string()),
        Just("Nodes".to_string()),
        Just("items".to_string()),
        Just("metadata".to_string()),
        Just("name".to_string()),
        Just("PodName".to_string()),
        Just("podnamespace".to_string()),
        Just("PodUID".to_string()),
        Just("Node".to_string()),
        Just("spec".to_string()),
        Just("containers".to_string()),
        Just("resources".to_string()),
        Just("limits".to_string()),
        Just("aliyun.com/gpu-mem".to_string()),
        "[a-zA-Z]{0,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        Just(json!("-1")),
        Just(json!("99999999999999999999Gi")),
        Just(json!("4")),
    ];
    leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Bytes that are JSON-ish: valid documents, truncated ones, and raw noise.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        json_value().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        (json_value(), any::<usize>()).prop_map(|(v, cut)| {
            let mut b = serde_json::to_vec(&v).unwrap_or_default();
            b.truncate(cut % (b.len() + 1));
            b
        }),
        prop::collection::vec(any::<u8>(), 0..256),
        (1usize..200).prop_map(|depth| {
            // Deep nesting: must be refused, not overflow the stack.
            let mut s = "[".repeat(depth * 10);
            s.push_str(&"]".repeat(depth * 10));
            s.into_bytes()
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoders_never_panic(bytes in body()) {
        let _ = decode_extender_args(&bytes);
        let _ = decode_binding_args(&bytes);
    }
}

/// Fails unless the extender still answers `/healthz` with 200.
async fn assert_alive(addr: std::net::SocketAddr) {
    let r = http(http::Method::GET, &format!("http://{addr}/healthz"), None).await;
    assert_eq!(r.map(|r| r.0), Some(200), "the extender stopped answering");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_4xx_and_the_server_survives() {
    let api = sandbox(3, 2, 8).await;
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");
    let base = format!("http://{}/gpushare-scheduler", ext.addr);
    let mut runner = TestRunner::deterministic();
    let strategy = body();
    for i in 0..150 {
        let bytes = strategy
            .new_tree(&mut runner)
            .map(|t| t.current())
            .unwrap_or_default();
        for verb in ["filter", "prioritize", "bind"] {
            let r = http(
                http::Method::POST,
                &format!("{base}/{verb}"),
                Some(bytes.clone()),
            )
            .await;
            let (status, resp) =
                r.unwrap_or_else(|| panic!("case {i}: {verb} dropped the connection"));
            let allowed = match verb {
                // Bind's documented failure answer is 500 with {"Error": ...}.
                "bind" => matches!(status, 200 | 400 | 500),
                _ => matches!(status, 200 | 400),
            };
            assert!(
                allowed,
                "case {i}: {verb} answered {status} to {:?}: {}",
                String::from_utf8_lossy(&bytes),
                String::from_utf8_lossy(&resp)
            );
            if status != 200 {
                let v: Value = serde_json::from_slice(&resp).unwrap_or(Value::Null);
                assert!(
                    v.get("Error")
                        .and_then(Value::as_str)
                        .is_some_and(|e| !e.is_empty()),
                    "case {i}: {verb} {status} without a JSON error: {}",
                    String::from_utf8_lossy(&resp)
                );
            }
        }
    }
    // Wrong methods and unknown paths.
    let r = http(http::Method::GET, &format!("{base}/filter"), None).await;
    assert_eq!(r.map(|r| r.0), Some(405));
    let r = http(
        http::Method::POST,
        &format!("{base}/../../etc/passwd"),
        None,
    )
    .await;
    assert!(matches!(r.map(|r| r.0), Some(404) | Some(400)));
    assert_alive(ext.addr).await;
    ext.stop().await;
}

/// `VmRSS` of this process in bytes (0 where /proc is unavailable).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_bodies_get_413_without_growing_memory() {
    let api = sandbox(1, 1, 8).await;
    let mut config = extender_config(false);
    config.extender.max_body_bytes = 1024 * 1024;
    let ext = start_extender(&api, &config).await;
    ext.wait_ready().await.expect("ready");

    // Declared too large: refused on the header alone.
    let mut s = TcpStream::connect(ext.addr).await.expect("connect");
    let head = "POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 17179869184\r\n\r\n";
    s.write_all(head.as_bytes()).await.expect("write");
    let answer = read_head(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    // Streamed without a length (chunked), 8 MiB each, 32 times: 256 MiB offered in all.
    // The server may answer 413 and close while we still write; a reset before we read the
    // answer is a refusal too. Accepting the body would read as 400 (it is not JSON).
    let before = rss();
    for _ in 0..32 {
        let head = stream_chunked(ext.addr, 8 * 1024 * 1024).await;
        assert!(
            head.is_empty() || head.starts_with("HTTP/1.1 413"),
            "a huge chunked body was answered {head:?}"
        );
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 128 * 1024 * 1024,
        "resident memory grew by {} MiB over 256 MiB of refused bodies",
        grown / (1024 * 1024)
    );
    assert_alive(ext.addr).await;
    ext.stop().await;
}

/// Sends a chunked POST of `total` bytes to filter while reading the answer; the answer's
/// head ("" when the connection was reset or closed first).
async fn stream_chunked(addr: std::net::SocketAddr, total: usize) -> String {
    let Ok(s) = TcpStream::connect(addr).await else {
        return String::new();
    };
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let head = "POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\n\
                    Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
        if wr.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let chunk = vec![b' '; 64 * 1024];
        let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
        frame.extend_from_slice(&chunk);
        frame.extend_from_slice(b"\r\n");
        for _ in 0..total / chunk.len() {
            if wr.write_all(&frame).await.is_err() {
                return;
            }
        }
        let _ = wr.write_all(b"0\r\n\r\n").await;
    });
    let mut buf = Vec::new();
    let mut byte = [0u8; 1024];
    let read = async {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match rd.read(&mut byte).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&byte[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(20), read).await;
    writer.abort();
    String::from_utf8_lossy(&buf).into_owned()
}

/// Reads until the end of a response head (or EOF / 20 s); the head as text.
async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1024];
    let read = async {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut byte).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&byte[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(20), read).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_connections_are_cut_and_others_still_served() {
    let api = sandbox(1, 1, 8).await;
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");
    let addr = ext.addr;
    const LORIS: usize = 64;
    let mut lorises = Vec::new();
    for _ in 0..LORIS {
        lorises.push(tokio::spawn(async move {
            let Ok(mut s) = TcpStream::connect(addr).await else {
                return false;
            };
            let head = b"POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\nX-Slow: ";
            // One byte every 250 ms, forever: only the server's header timeout ends it.
            let trickle = async {
                for b in head.iter().chain(std::iter::repeat(&b'a')) {
                    if s.write_all(&[*b]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            };
            // The server cutting us is the only way out within the deadline.
            tokio::time::timeout(Duration::from_secs(60), trickle)
                .await
                .is_ok()
        }));
    }
    // Meanwhile, others are served.
    for _ in 0..20 {
        assert_alive(addr).await;
    }
    for l in lorises {
        assert!(
            l.await.unwrap_or(false),
            "a slow-loris connection was still open after 60 s (no header read timeout)"
        );
    }
    assert_alive(addr).await;
    ext.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_keep_alive_connections_do_not_take_it_down() {
    let api = sandbox(1, 1, 8).await;
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");
    let addr = ext.addr;
    let mut open = Vec::new();
    // Opened in batches so the listen backlog is not the thing under test.
    for _ in 0..8 {
        let batch: Vec<_> = (0..250)
            .map(|_| {
                tokio::spawn(async move {
                    let mut s = TcpStream::connect(addr).await.ok()?;
                    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                        .await
                        .ok()?;
                    let head = read_head(&mut s).await;
                    head.starts_with("HTTP/1.1 200").then_some(s)
                })
            })
            .collect();
        for task in batch {
            if let Ok(Some(s)) = task.await {
                open.push(s);
            }
        }
    }
    assert_eq!(open.len(), 2000, "every connection was served");
    // With all of them open, a new client is still served.
    assert_alive(addr).await;
    drop(open);
    assert_alive(addr).await;
    ext.stop().await;
}
