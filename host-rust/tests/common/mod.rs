//! A small scripted HTTP/1.1 server on 127.0.0.1 (tokio `TcpListener`), bounded and
//! self-stopping, and a metrics recorder that counts into memory.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// One scripted response.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub delay: Duration,
    pub body: String,
    /// Time between the body's bytes (a trickling server); zero sends the body at once.
    pub trickle: Duration,
    /// Close the connection after half the body.
    pub cut: bool,
}

impl Resp {
    pub fn status(status: u16) -> Self {
        Resp { status, headers: Vec::new(), delay: Duration::ZERO, body: format!("status {status}"), trickle: Duration::ZERO, cut: false }
    }
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
    pub fn body(mut self, body: &str) -> Self {
        self.body = body.to_string();
        self
    }
    pub fn trickle(mut self, every: Duration) -> Self {
        self.trickle = every;
        self
    }
    pub fn cut(mut self) -> Self {
        self.cut = true;
        self
    }
}

type Script = Arc<dyn Fn(&str, u32) -> Resp + Send + Sync>;

/// A running server; stops when dropped, or by itself after `LIFETIME`.
pub struct Server {
    pub addr: std::net::SocketAddr,
    hits: Arc<Mutex<HashMap<String, u32>>>,
    task: JoinHandle<()>,
}

const LIFETIME: Duration = Duration::from_secs(60);
const MAX_CONNECTIONS: u32 = 10_000;

impl Server {
    /// Serve `script(path, n)` for the n-th request (from 1) of each path.
    pub async fn start(script: impl Fn(&str, u32) -> Resp + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
        Self::on(listener, Arc::new(script))
    }

    /// Serve on a given port (to bring a dead port back).
    pub async fn start_on(port: u16, script: impl Fn(&str, u32) -> Resp + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("bind the port again");
        Self::on(listener, Arc::new(script))
    }

    fn on(listener: TcpListener, script: Script) -> Server {
        let addr = listener.local_addr().expect("local addr");
        let hits: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let h = hits.clone();
        let task = tokio::spawn(async move {
            let serve = async {
                for _ in 0..MAX_CONNECTIONS {
                    let Ok((mut sock, _)) = listener.accept().await else { return };
                    let script = script.clone();
                    let hits = h.clone();
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        let mut chunk = [0u8; 4096];
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 65_536 {
                            match sock.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        let head = String::from_utf8_lossy(&buf).to_string();
                        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                        let n = {
                            let mut m = hits.lock().expect("hits");
                            let c = m.entry(path.clone()).or_insert(0);
                            *c += 1;
                            *c
                        };
                        let resp = script(&path, n);
                        tokio::time::sleep(resp.delay).await;
                        let mut out = format!("HTTP/1.1 {} X\r\ncontent-length: {}\r\nconnection: close\r\n", resp.status, resp.body.len());
                        for (k, v) in &resp.headers {
                            out.push_str(&format!("{k}: {v}\r\n"));
                        }
                        out.push_str("\r\n");
                        if resp.cut {
                            out.push_str(&resp.body[..resp.body.len() / 2]);
                            let _ = sock.write_all(out.as_bytes()).await;
                            return; // dropped: the connection closes mid-body
                        }
                        if !resp.trickle.is_zero() {
                            let _ = sock.write_all(out.as_bytes()).await;
                            for b in resp.body.bytes() {
                                if sock.write_all(&[b]).await.is_err() {
                                    return;
                                }
                                tokio::time::sleep(resp.trickle).await;
                            }
                            let _ = sock.shutdown().await;
                            return;
                        }
                        out.push_str(&resp.body);
                        let _ = sock.write_all(out.as_bytes()).await;
                        let _ = sock.shutdown().await;
                    });
                }
            };
            let _ = tokio::time::timeout(LIFETIME, serve).await;
        });
        Server { addr, hits, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn hits(&self, path: &str) -> u32 {
        self.hits.lock().expect("hits").get(path).copied().unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A port nobody listens on (bound, then released).
pub fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

/// What `describe_*` said of an instrument: its kind, unit and description.
pub type Description = (&'static str, Option<metrics::Unit>, String);

/// Counters and gauges recorded in memory, by name and sorted labels.
#[derive(Default)]
pub struct Recorder {
    counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// What `describe_*` said of each instrument: its kind, unit and description.
    descriptions: Mutex<HashMap<String, Description>>,
}

fn key_name(key: &metrics::Key) -> String {
    let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl metrics::Recorder for Recorder {
    fn describe_counter(&self, name: metrics::KeyName, unit: Option<metrics::Unit>, help: metrics::SharedString) {
        self.describe("counter", name, unit, help);
    }
    fn describe_gauge(&self, name: metrics::KeyName, unit: Option<metrics::Unit>, help: metrics::SharedString) {
        self.describe("gauge", name, unit, help);
    }
    fn describe_histogram(&self, name: metrics::KeyName, unit: Option<metrics::Unit>, help: metrics::SharedString) {
        self.describe("histogram", name, unit, help);
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let c = self.counters.lock().expect("counters").entry(key_name(key)).or_default().clone();
        metrics::Counter::from_arc(c)
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let g = self.gauges.lock().expect("gauges").entry(key_name(key)).or_default().clone();
        metrics::Gauge::from_arc(g)
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

impl Recorder {
    fn describe(&self, kind: &'static str, name: metrics::KeyName, unit: Option<metrics::Unit>, help: metrics::SharedString) {
        self.descriptions.lock().expect("descriptions").insert(name.as_str().to_string(), (kind, unit, help.to_string()));
    }
    /// What `describe_*` said of `name`: its kind, unit and description.
    pub fn description(&self, name: &str) -> Option<Description> {
        self.descriptions.lock().expect("descriptions").get(name).cloned()
    }
    /// The counter `name{labels}` (labels sorted, `k=v` joined by commas).
    pub fn counter(&self, name: &str) -> u64 {
        self.counters.lock().expect("counters").get(name).map(|c| c.load(Ordering::Relaxed)).unwrap_or(0)
    }
    /// The gauge `name{labels}`.
    pub fn gauge(&self, name: &str) -> Option<f64> {
        self.gauges.lock().expect("gauges").get(name).map(|g| f64::from_bits(g.load(Ordering::Relaxed)))
    }
}

/// The process-wide recorder of this test binary.
pub fn recorder() -> &'static Recorder {
    static R: OnceLock<&'static Recorder> = OnceLock::new();
    R.get_or_init(|| {
        let r: &'static Recorder = Box::leak(Box::default());
        let _ = metrics::set_global_recorder(r);
        r
    })
}
