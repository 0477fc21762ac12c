//! A canned HTTP server on loopback: every request is answered with one status and body,
//! and the paths asked for are recorded. What a test needs of a server that is not one of
//! ours (an extender whose answer is given, something else listening where the API server
//! should be).

use std::sync::{Arc, Mutex};

/// An HTTP server answering every request with `status` and `body`; records the request paths.
pub(crate) struct CannedServer {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    paths: Arc<Mutex<Vec<String>>>,
    /// Serves until the fake is dropped.
    _runtime: tokio::runtime::Runtime,
}

impl CannedServer {
    /// Starts serving on a loopback port.
    pub(crate) fn start(status: u16, body: String) -> CannedServer {
        use http_body_util::Full;
        use hyper::service::service_fn;
        use hyper_util::rt::TokioIo;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let paths = Arc::new(Mutex::new(Vec::new()));
        let seen = paths.clone();
        runtime.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                let body = body.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        seen.lock()
                            .expect("lock")
                            .push(req.uri().path().to_string());
                        let response = hyper::Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(Full::new(bytes::Bytes::from(body.clone())));
                        async move { response }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        CannedServer {
            url,
            paths,
            _runtime: runtime,
        }
    }

    /// The paths asked for, in order.
    pub(crate) fn paths(&self) -> Vec<String> {
        self.paths.lock().expect("lock").clone()
    }
}
