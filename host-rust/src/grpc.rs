//! gRPC through tonic (feature `grpc`): the tower layer of [`crate::layer`] for a tonic
//! channel, with gRPC's own semantics (README, "gRPC"; docs/grpc.md).
//!
//! ```ignore
//! let channel = tonic::transport::Endpoint::from_static("http://10.0.0.7:50051").connect_lazy();
//! let svc = tower::ServiceBuilder::new().layer(LeveeLayer::new(levee, "grpc-default")?.grpc()).service(channel);
//! let mut client = MyClient::with_origin(svc, "http://10.0.0.7:50051".parse()?);
//! ```
//!
//! What the host does (the core decides everything else):
//! - **Classification**: each attempt is reported as the gRPC status (`grpc-status` of a
//!   trailers-only response's headers, or of the trailers), never the HTTP status, with the raw
//!   `grpc-retry-pushback-ms` of the same metadata passed through unparsed. A transport error
//!   is the status tonic makes of it (UNAVAILABLE for a refused connection); tonic's own
//!   per-request timer firing is a `timeout`. An HTTP response without any `grpc-status` is the
//!   status gRPC's HTTP-to-gRPC mapping gives it, as tonic reads it.
//! - **Streams and the commit** (A6): an attempt is retried only until its first response
//!   message (a non-empty DATA frame) arrives; from then on it is committed. A committed
//!   attempt stays the call's attempt until its stream ends, and that end is its outcome,
//!   reported to the core (breaker, budget, events, metrics) and never retried (the layer
//!   answers "no retry" for a committed attempt's failure, whatever the layer's `retry_if`
//!   says): OK trailers are a `success`, a `grpc-status` in the trailers is that status (with
//!   its pushback), a transport error while the body streams is the status tonic makes of it,
//!   a stream ending with no status is UNKNOWN. What is already there when the first message
//!   arrives is read at once (a unary answer usually comes whole: it ends the attempt there);
//!   otherwise the call's future returns the response at the commit and its body carries the
//!   call on: the messages reach the caller as they come, and the body's last frame (the
//!   trailers or the error) comes after the core has recorded the attempt. The attempt's
//!   timeout and the caller's deadline still run: when one passes first, the stream ends with
//!   the call's status. Dropping the body before its end is the caller's cancellation (the
//!   call is cancelled in the engine, as when the call's future is dropped, and the stream is
//!   reset), not a failure of the dependency. **A bulkhead slot is held until the stream
//!   ends** (or the body is dropped). Under a hedging policy the first attempt to commit wins
//!   and ends the hedged call at its commit (the others are cancelled), as in the JS host: the
//!   rest of its stream goes to the caller and is not reported.
//! - **Request bodies**: the request body's frames are read before the call starts, as far as
//!   they are ready without waiting. A body that ends that way (every unary call, and a client
//!   stream over messages already in memory) is kept as bytes and each attempt sends a copy. A
//!   body that would wait (a client stream fed by a channel) cannot be replayed: the call is
//!   started not idempotent, so the core never asks for a second attempt (nor a hedge), and the
//!   one attempt sends what was read and then the rest of the stream.
//! - **Deadlines**: each attempt carries `grpc-timeout` = the attempt timeout the core granted
//!   (already within the policy's time left), never more than the caller's own `grpc-timeout`
//!   left (tonic's `Request::set_timeout`), which also bounds the whole call (DEADLINE_EXCEEDED
//!   when it passes).
//! - `grpc-previous-rpc-attempts: N-1` on attempt N > 1 (A6), and `x-levee-attempt: N` (the
//!   cross-layer header of the HTTP integrations, docs/envoy.md) on every attempt.
//! - **Hedging**: a policy with `hedge` runs attempts concurrently through the host's hedged
//!   driver; a loser's future is dropped, which resets its HTTP/2 stream (the server sees the
//!   cancellation).
//! - **Errors**: a call the policy gives up on after a response returns that response (tonic
//!   makes the server's status of it); after a transport error, that error's status; a call
//!   refused by the policy is a [`tonic::Status`] whose source is the [`LeveeError`]
//!   ([`rejection_code`]: RESOURCE_EXHAUSTED for a rate limit or a full bulkhead, UNAVAILABLE
//!   for an open breaker, DEADLINE_EXCEEDED for the deadline).
//! - **Cancellation**: dropping the call's future (or, after the commit, the response's body)
//!   drops the attempt in flight (its stream is reset) and cancels the call in the engine; it
//!   is never retried. (tonic's own `Request::cancellation_handle` acts on the request body,
//!   which this layer has read: drop the future instead.)
//!
//! Retry in one layer only: tonic has no retry of its own (its channel sends each request
//! once), so nothing needs turning off in tonic; do not add `tower::retry` below this layer.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body::{Body as HttpBody, Frame, SizeHint};
use levee_core::Reason;
use tokio::sync::oneshot;
use tonic::body::Body;
use tonic::{Code, Status};

use crate::call::BoxFuture;
use crate::layer::OneShot;
use crate::outcome::{IntoOutcome, Outcome};
use crate::{Levee, LeveeError, RetryIf, UnknownPolicy};

/// The header of the server's pushback (A6), from the contract.
pub const PUSHBACK: &str = crate::constants::HTTP_PUSHBACK_TRAILER;
/// A6's count of the attempts already sent, on every attempt after the first.
pub const PREVIOUS_ATTEMPTS: &str = crate::constants::GRPC_PREVIOUS_ATTEMPTS_HEADER;
/// gRPC's deadline header (PROTOCOL-HTTP2.md, `Timeout`).
pub const TIMEOUT: &str = "grpc-timeout";
const STATUS: &str = "grpc-status";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A function of a call's method path (`/package.Service/Method`): the policy for it, `None`
/// for the layer's own.
pub type PolicyFn = Arc<dyn Fn(&str) -> Option<Arc<str>> + Send + Sync>;
/// A function of a call's URI and metadata: its key.
pub type KeyFn = Arc<dyn Fn(&http::Uri, &HeaderMap) -> String + Send + Sync>;

#[derive(Clone)]
enum Key {
    /// The request's authority (`host:port`, as the HTTP layer's key).
    Authority,
    Fixed(Arc<str>),
    Call(KeyFn),
}

/// Wraps a tonic channel (any `tower::Service<http::Request<tonic::body::Body>>`) in
/// [`GrpcService`]. Made by [`crate::layer::LeveeLayer::grpc`] or [`GrpcLayer::new`].
#[derive(Clone)]
pub struct GrpcLayer {
    levee: Levee,
    policy: Arc<str>,
    policy_fn: Option<PolicyFn>,
    key: Key,
    retry_if: Option<RetryIf>,
}

impl std::fmt::Debug for GrpcLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcLayer").field("policy", &self.policy).finish_non_exhaustive()
    }
}

impl GrpcLayer {
    /// Run calls under the named policy of `levee` (an [`UnknownPolicy`] error for a name the
    /// document does not have).
    pub fn new(levee: Levee, policy: &str) -> Result<Self, UnknownPolicy> {
        levee.policy(policy)?;
        Ok(GrpcLayer { levee, policy: Arc::from(policy), policy_fn: None, key: Key::Authority, retry_if: None })
    }

    pub(crate) fn from_layer(levee: Levee, policy: Arc<str>, key: Option<Arc<str>>, retry_if: Option<RetryIf>) -> Self {
        GrpcLayer { levee, policy, policy_fn: None, key: key.map_or(Key::Authority, Key::Fixed), retry_if }
    }

    /// Choose the policy per method: `f` is given the method's path (`/pkg.Service/Method`)
    /// and answers a policy name, or `None` for the layer's. A name the document does not
    /// have fails the call (INTERNAL, with the [`LeveeError`] naming the policies it has).
    pub fn policy_fn(mut self, f: impl Fn(&str) -> Option<Arc<str>> + Send + Sync + 'static) -> Self {
        self.policy_fn = Some(Arc::new(f));
        self
    }

    /// Use one fixed key instead of each request's authority.
    pub fn with_key(mut self, key: &str) -> Self {
        self.key = Key::Fixed(Arc::from(key));
        self
    }

    /// The key of each call as a function of its URI and metadata (the default is the URI's
    /// authority, `host:port`: build the client with `with_origin`, as a channel's requests
    /// below the client carry only their path).
    pub fn key_fn(mut self, f: impl Fn(&http::Uri, &HeaderMap) -> String + Send + Sync + 'static) -> Self {
        self.key = Key::Call(Arc::new(f));
        self
    }

    /// The retry predicate of every call through this layer (as [`crate::layer::LeveeLayer::retry_if`]):
    /// it sees an attempt's `http::Response<tonic::body::Body>` or its [`tonic::Status`].
    pub fn retry_if(mut self, f: impl Fn(&crate::Attempted<'_>) -> Option<bool> + Send + Sync + 'static) -> Self {
        self.retry_if = Some(Arc::new(f));
        self
    }
}

impl<S> tower_layer::Layer<S> for GrpcLayer {
    type Service = GrpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcService { inner, layer: self.clone() }
    }
}

/// A tonic channel whose calls run under a Levee policy (see the module's documentation).
#[derive(Clone)]
pub struct GrpcService<S> {
    inner: S,
    layer: GrpcLayer,
}

impl<S: std::fmt::Debug> std::fmt::Debug for GrpcService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcService").field("inner", &self.inner).field("layer", &self.layer).finish()
    }
}

/// A request body kept for the attempts: the bytes every attempt sends a copy of, or (a body
/// that cannot be replayed) what was read and the rest, for one attempt.
enum Sent {
    Replay(Bytes, Option<HeaderMap>),
    Once(Option<Replay<Body>>),
}

impl Sent {
    fn body(&mut self) -> Option<Body> {
        match self {
            Sent::Replay(data, trailers) => {
                Some(Body::new(Replay::<Body> { data: (!data.is_empty()).then(|| data.clone()), trailers: trailers.clone(), rest: None }))
            }
            Sent::Once(once) => once.take().map(Body::new),
        }
    }
}

/// Read the frames of `body` that are ready without waiting: all of it (`Sent::Replay`) or
/// the part read and the rest (`Sent::Once`).
async fn read_ready(mut body: Body) -> Result<Sent, Status> {
    let mut data = BytesMut::new();
    let mut first: Option<Bytes> = None;
    let mut trailers: Option<HeaderMap> = None;
    let ended = std::future::poll_fn(|cx| loop {
        match Pin::new(&mut body).poll_frame(cx) {
            Poll::Pending => return Poll::Ready(Ok(false)),
            Poll::Ready(None) => return Poll::Ready(Ok(true)),
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => match first.take() {
                    // One frame (a unary request) is kept as it is; more are joined.
                    None if data.is_empty() => first = Some(d),
                    prev => {
                        if let Some(p) = prev {
                            data.extend_from_slice(&p);
                        }
                        data.extend_from_slice(&d);
                    }
                },
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                }
            },
        }
    })
    .await?;
    let read = first.unwrap_or_else(|| data.freeze());
    if ended {
        return Ok(Sent::Replay(read, trailers));
    }
    Ok(Sent::Once(Some(Replay { data: (!read.is_empty()).then_some(read), trailers: None, rest: Some(body) })))
}

/// A body that sends `data`, then the frames of `rest`, then `trailers`.
struct Replay<B> {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<B>,
}

impl<B> HttpBody for Replay<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(rest) = self.rest.as_mut() {
            match Pin::new(rest).poll_frame(cx) {
                Poll::Ready(None) => self.rest = None,
                other => return other,
            }
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.rest.as_ref().map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint());
        let n = self.data.as_ref().map_or(0, |d| d.len() as u64);
        // The upper bound first: `set_lower` asserts that the lower stays within it.
        if let Some(u) = hint.upper() {
            hint.set_upper(u.saturating_add(n));
        }
        hint.set_lower(hint.lower().saturating_add(n));
        hint
    }
}

/// An attempt's outcome known from its trailers (the status came after the response head,
/// before any message), kept in the response's extensions for the classification.
#[derive(Clone, Debug)]
struct Trailed(Outcome);

/// The outcome of a gRPC status and the metadata it came with.
fn status_outcome(code: i32, metadata: &HeaderMap) -> Outcome {
    let pushback =
        metadata.get(PUSHBACK).map(|v| Cow::Owned(String::from_utf8_lossy(v.as_bytes()).into_owned())).unwrap_or(Cow::Borrowed(""));
    Outcome::Grpc { code, pushback }
}

/// The status code in `grpc-status`, read as tonic reads it.
fn code_of(headers: &HeaderMap) -> Option<i32> {
    headers.get(STATUS).map(|v| Code::from_bytes(v.as_bytes()) as i32)
}

/// The status of a response without `grpc-status`, by its HTTP status: gRPC's
/// http-grpc-status-mapping.md, as tonic reads such a response (`infer_grpc_status`).
fn http_code(status: http::StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

impl IntoOutcome for Status {
    /// The status's code and its metadata's raw `grpc-retry-pushback-ms`; tonic's own timer
    /// (the `grpc-timeout` of the request, or the endpoint's timeout) firing is a `timeout`.
    fn outcome(&self) -> Outcome {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(self);
        while let Some(e) = cur {
            if e.is::<tonic::TimeoutExpired>() {
                return Outcome::Timeout;
            }
            cur = e.source();
        }
        status_outcome(self.code() as i32, self.metadata().as_ref())
    }
}

/// The outcome of an attempt (see the module's documentation).
fn classify(r: &Result<http::Response<Body>, Status>) -> Outcome {
    match r {
        Err(s) => s.outcome(),
        Ok(resp) => {
            if let Some(Trailed(o)) = resp.extensions().get::<Trailed>() {
                return o.clone();
            }
            match code_of(resp.headers()) {
                Some(code) => status_outcome(code, resp.headers()),
                // The first message arrived: committed.
                None => Outcome::Success,
            }
        }
    }
}

/// A stream that ended with no `grpc-status`: UNKNOWN, as tonic reports it.
const NO_STATUS: Outcome = Outcome::Grpc { code: Code::Unknown as i32, pushback: Cow::Borrowed("") };

/// Marks the result of an attempt whose first response message arrived (A6's commit): a
/// failure of it is final.
#[derive(Clone, Copy, Debug)]
struct Committed;

/// How far an attempt got while the call waited for it (see the module's documentation).
enum Commit {
    /// Not committed: the status came before any message (or the attempt failed).
    Ended(Result<http::Response<Body>, Status>),
    /// Committed, and the stream was already whole: its messages and its end, read at once
    /// (a unary answer, as a rule). The outcome is in [`Trailed`].
    Whole(http::Response<Body>),
    /// Committed, and the stream goes on: the head, and a body replaying what was read.
    Open(http::response::Parts, Buffered),
}

/// The end of a committed stream as an attempt's result: a response whose [`Trailed`] outcome
/// is the stream's status (`Success` for OK), marked [`Committed`].
fn ended(outcome: Outcome) -> http::Response<Body> {
    let mut resp = http::Response::new(Body::empty());
    resp.extensions_mut().insert(Trailed(outcome));
    resp.extensions_mut().insert(Committed);
    resp
}

/// The outcome of a committed stream's trailers: `Success` for OK (a first attempt's success
/// is then held back, as on every call's hot path), else the status and its pushback.
fn trailers_outcome(trailers: &HeaderMap) -> Outcome {
    match code_of(trailers).unwrap_or(Code::Unknown as i32) {
        0 => Outcome::Success,
        code => status_outcome(code, trailers),
    }
}

/// Wait for the status of a response, or its first message; after the first message, read on
/// as far as the stream is ready without waiting (see the module's documentation).
async fn commit<RB>(resp: http::Response<RB>) -> Commit
where
    RB: HttpBody<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    if resp.headers().contains_key(STATUS) {
        // Trailers-only: the status is in the head.
        return Commit::Ended(Ok(resp.map(Body::new)));
    }
    let (mut parts, body) = resp.into_parts();
    if parts.status != http::StatusCode::OK {
        let code = http_code(parts.status) as i32;
        parts.extensions.insert(Trailed(Outcome::Grpc { code, pushback: Cow::Borrowed("") }));
        return Commit::Ended(Ok(http::Response::from_parts(parts, Body::new(body))));
    }
    let mut body = Body::new(body);
    let first = loop {
        match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            None => {
                // Ended with no status: tonic reports UNKNOWN.
                parts.extensions.insert(Trailed(NO_STATUS));
                return Commit::Ended(Ok(http::Response::from_parts(parts, Body::empty())));
            }
            Some(Err(e)) => return Commit::Ended(Err(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) if d.is_empty() => continue,
                Ok(d) => break d,
                Err(frame) => {
                    let Ok(trailers) = frame.into_trailers() else { continue };
                    let code = code_of(&trailers).unwrap_or(Code::Unknown as i32);
                    parts.extensions.insert(Trailed(status_outcome(code, &trailers)));
                    let replay = Buffered { frames: VecDeque::from([Ok(Frame::trailers(trailers))]), rest: None };
                    return Commit::Ended(Ok(http::Response::from_parts(parts, Body::new(replay))));
                }
            },
        }
    };
    // Committed. What is already there is read now: a stream already whole (a unary answer)
    // ends the attempt here, with no hand-over.
    let mut frames = VecDeque::from([Ok(Frame::data(first))]);
    let end = std::future::poll_fn(|cx| loop {
        match Pin::new(&mut body).poll_frame(cx) {
            Poll::Pending => return Poll::Ready(None),
            Poll::Ready(None) => return Poll::Ready(Some(NO_STATUS)),
            Poll::Ready(Some(Err(e))) => {
                let outcome = e.outcome();
                frames.push_back(Err(e));
                return Poll::Ready(Some(outcome));
            }
            Poll::Ready(Some(Ok(frame))) => {
                let outcome = frame.trailers_ref().map(trailers_outcome);
                frames.push_back(Ok(frame));
                if outcome.is_some() {
                    return Poll::Ready(outcome);
                }
            }
        }
    })
    .await;
    match end {
        None => Commit::Open(parts, Buffered { frames, rest: Some(body) }),
        Some(outcome) => {
            parts.extensions.insert(Trailed(outcome));
            parts.extensions.insert(Committed);
            Commit::Whole(http::Response::from_parts(parts, Body::new(Buffered { frames, rest: None })))
        }
    }
}

/// A response body: the frames already read, then the rest of the stream.
struct Buffered {
    frames: VecDeque<Result<Frame<Bytes>, Status>>,
    rest: Option<Body>,
}

impl HttpBody for Buffered {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(f) = self.frames.pop_front() {
            return Poll::Ready(Some(f));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.rest.as_ref().is_none_or(HttpBody::is_end_stream)
    }
}

/// What an attempt that committed to an open stream and the call's future share: the
/// committed response with the sender of its end, handed over once.
#[derive(Default)]
struct Handoff {
    /// An attempt committed to an open stream: the call's attempt until the stream ends
    /// (whatever ends it is final).
    committed: AtomicBool,
    slot: Mutex<Option<(http::Response<Body>, oneshot::Sender<AttemptResult>)>>,
}

type AttemptResult = Result<http::Response<Body>, Status>;

/// The retry predicate of a call: a failure of an attempt that committed (its first message
/// arrived) is final (A6); anything else is the layer's predicate's (if any) to answer. A
/// success is left to the policy (a no-retry answer would count it as a failure).
fn committed_retry_if(handoff: Arc<Handoff>, user: Option<RetryIf>) -> RetryIf {
    Arc::new(move |a: &crate::Attempted<'_>| {
        let failed = !matches!(a.outcome(), Outcome::Success | Outcome::Grpc { code: 0, .. });
        let marked = || a.value::<http::Response<Body>>().is_some_and(|r| r.extensions().get::<Committed>().is_some());
        if failed && (handoff.committed.load(Ordering::Acquire) || marked()) {
            return Some(false);
        }
        user.as_ref().and_then(|f| f(a))
    })
}

/// The future of a call through [`GrpcService`]: the call until it ends, or until an attempt
/// commits to an open stream, whose response it then returns with a body that carries the
/// call on (see the module's documentation, "Streams").
pub struct ResponseFuture {
    call: Option<BoxFuture<'static, AttemptResult>>,
    handoff: Arc<Handoff>,
}

impl std::fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<Body>, Status>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(call) = this.call.as_mut() else {
            return Poll::Ready(Err(Status::internal("levee: the call's future was polled after it ended")));
        };
        if let Poll::Ready(r) = call.as_mut().poll(cx) {
            this.call = None;
            return Poll::Ready(r);
        }
        // An attempt hands its open stream over from inside the call's poll, just made.
        let handed = this.handoff.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        match handed {
            None => Poll::Pending,
            Some((resp, end)) => {
                let call = this.call.take();
                Poll::Ready(Ok(resp.map(|body| Body::new(OpenStream { body: Some(body), end: Some(end), call, last: None }))))
            }
        }
    }
}

/// The body of a committed stream: the attempt's messages as they come; its end (trailers, an
/// error, or no status) goes to the attempt, which the call reports, and the body's last frame
/// comes once the call has ended. The call runs beside the stream: the attempt's timeout or
/// the caller's deadline passing ends the stream with the call's status. Dropped before its
/// end, the body drops the call (the caller's cancellation) and resets the stream.
struct OpenStream {
    body: Option<Body>,
    end: Option<oneshot::Sender<AttemptResult>>,
    call: Option<BoxFuture<'static, AttemptResult>>,
    /// The stream's last frame, held while the call reports it (`Some(None)`: no frame).
    last: Option<Option<Result<Frame<Bytes>, Status>>>,
}

impl HttpBody for OpenStream {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.last.is_some() {
            // The end was sent: wait for the call to report it.
            if let Some(call) = this.call.as_mut() {
                if call.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.call = None;
            }
            return Poll::Ready(this.last.take().flatten());
        }
        if let Some(call) = this.call.as_mut() {
            if let Poll::Ready(r) = call.as_mut().poll(cx) {
                // The call ended before the stream did (the attempt's timeout, the caller's
                // deadline): its status ends the stream.
                this.call = None;
                this.end = None;
                if let Err(s) = r {
                    this.body = None;
                    return Poll::Ready(Some(Err(s)));
                }
            }
        }
        let Some(body) = this.body.as_mut() else { return Poll::Ready(None) };
        let frame = match Pin::new(body).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(f))) if f.is_data() => return Poll::Ready(Some(Ok(f))),
            Poll::Ready(frame) => frame,
        };
        this.body = None;
        let result = match &frame {
            Some(Ok(f)) => Ok(ended(f.trailers_ref().map_or(Outcome::Success, trailers_outcome))),
            Some(Err(s)) => Err(s.clone()),
            None => Ok(ended(NO_STATUS)),
        };
        let sent = this.end.take().is_some_and(|end| end.send(result).is_ok());
        if !sent || this.call.is_none() {
            return Poll::Ready(frame);
        }
        this.last = Some(frame);
        // Poll the call now: it reports the end.
        self.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_none() && self.last.is_none()
    }
}

/// A `grpc-timeout` value (PROTOCOL-HTTP2.md: at most 8 digits and a unit); `None` when absent
/// or malformed (as tonic, which then ignores it).
pub fn parse_timeout(v: &HeaderValue) -> Option<Duration> {
    let b = v.as_bytes();
    let (unit, digits) = b.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n.saturating_mul(3600)),
        b'M' => Duration::from_secs(n.saturating_mul(60)),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `d` as a `grpc-timeout` value: the finest unit whose count fits in 8 digits, rounded down
/// (never more than `d`).
pub fn format_timeout(d: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let units: [(u128, u8); 6] =
        [(1, b'n'), (1_000, b'u'), (1_000_000, b'm'), (1_000_000_000, b'S'), (60_000_000_000, b'M'), (3_600_000_000_000, b'H')];
    let ns = d.as_nanos();
    let (count, unit) = units.iter().find(|(per, _)| ns / per <= MAX).map_or((MAX, b'H'), |(per, u)| (ns / per, *u));
    let mut s = count.to_string();
    s.push(char::from(unit));
    HeaderValue::from_str(&s).unwrap_or(HeaderValue::from_static("0n"))
}

/// The status a call refused or given up by the policy ends with, when no attempt left a
/// status of its own: the contract's table (`grpc.REJECTED_STATUS`: RESOURCE_EXHAUSTED for a
/// rate limit, a full bulkhead or a spent budget, UNAVAILABLE for an open breaker,
/// DEADLINE_EXCEEDED for the deadline, CANCELLED); else INTERNAL for a protocol error (an
/// unknown policy, a key too long), DEADLINE_EXCEEDED for a last attempt that timed out, and
/// the contract's UNKNOWN.
pub fn rejection_code<E>(e: &LeveeError<E>) -> Code {
    // The contract's table for a refusal, the same in every host (wit/constants.json).
    let name = e.reason.name();
    if let Some(&(_, code)) = crate::constants::GRPC_REJECTED_STATUS.iter().find(|(n, _)| *n == name) {
        return Code::from_i32(code as i32);
    }
    match e.reason {
        _ if e.invalid.is_some() || e.key_too_long.is_some() => Code::Internal,
        _ if e.outcome == Some(Outcome::Timeout) => Code::DeadlineExceeded,
        _ => Code::from_i32(crate::constants::GRPC_REJECTED_STATUS_OTHER as i32),
    }
}

/// The status the caller sees for `e`: the last attempt's status (code, message, metadata)
/// when it ended with one, else [`rejection_code`]'s; its source is `e`.
fn into_status(e: LeveeError<Status>) -> Status {
    let mut s = match &e.last {
        Some(last) => Status::with_details_and_metadata(
            last.code(),
            last.message().to_string(),
            Bytes::copy_from_slice(last.details()),
            last.metadata().clone(),
        ),
        None => Status::new(rejection_code(&e), e.to_string()),
    };
    s.set_source(Arc::new(e));
    s
}

/// What a call needs of the service, moved into its future.
struct CallParts {
    uri: http::Uri,
    version: http::Version,
    headers: HeaderMap,
    extensions: http::Extensions,
}

impl CallParts {
    fn request(&self, body: Body, attempt: crate::Attempt, deadline: Option<u64>, now: u64) -> http::Request<Body> {
        let mut req = http::Request::new(body);
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        *req.extensions_mut() = self.extensions.clone();
        let left = deadline.map(|d| Duration::from_nanos(d.saturating_sub(now)));
        let timeout = match (attempt.timeout, left) {
            (Some(a), Some(l)) => Some(a.min(l)),
            (a, l) => a.or(l),
        };
        let headers = req.headers_mut();
        match timeout {
            Some(t) => drop(headers.insert(TIMEOUT, format_timeout(t))),
            None => drop(headers.remove(TIMEOUT)),
        }
        if attempt.number > 1 {
            headers.insert(PREVIOUS_ATTEMPTS, HeaderValue::from(attempt.number - 1));
        }
        headers.insert(crate::outcome::HEADER_ATTEMPT, HeaderValue::from(attempt.number));
        req.extensions_mut().insert(attempt);
        req
    }
}

impl<S, RB> tower_service::Service<http::Request<Body>> for GrpcService<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    RB: HttpBody<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = http::Response<Body>;
    type Error = Status;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        // Readiness is awaited per attempt, on a clone of the inner service.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let GrpcLayer { levee, policy, policy_fn, key, retry_if } = self.layer.clone();
        let handoff = Arc::new(Handoff::default());
        let retry_if = committed_retry_if(handoff.clone(), retry_if);
        let handed = handoff.clone();
        let call = Box::pin(async move {
            let (parts, body) = req.into_parts();
            let policy = policy_fn.and_then(|f| f(parts.uri.path())).unwrap_or(policy);
            let key = match &key {
                Key::Authority => crate::outcome::http_key(&parts.uri),
                Key::Fixed(k) => k.to_string(),
                Key::Call(f) => f(&parts.uri, &parts.headers),
            };
            let shared = &*levee.shared;
            let deadline = parts
                .headers
                .get(TIMEOUT)
                .and_then(parse_timeout)
                .map(|d| shared.now().saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)));
            let mut sent = read_ready(body).await?;
            let once = matches!(sent, Sent::Once(_)) || parts.extensions.get::<OneShot>().is_some();
            let flags = if once { crate::constants::START_NON_IDEMPOTENT } else { 0 };
            let faults = parts.extensions.get::<crate::FaultPlan>().cloned().unwrap_or_default();
            let call_parts = CallParts { uri: parts.uri, version: parts.version, headers: parts.headers, extensions: parts.extensions };
            let call =
                levee.call::<http::Response<Body>, Status>(&policy).key(key).flags(flags).faults(&faults).retry_if_shared(Some(retry_if));
            let run = call.run_classified(classify, move |attempt| {
                let body = sent.body();
                let req = body.map(|b| call_parts.request(b, attempt, deadline, shared.now()));
                let mut svc = inner.clone();
                let handoff = handed.clone();
                async move {
                    let Some(req) = req else {
                        return Err(Status::internal("levee: the request stream was sent once and cannot be sent again"));
                    };
                    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.map_err(|e| Status::from_error(e.into()))?;
                    let resp = svc.call(req).await.map_err(|e| Status::from_error(e.into()))?;
                    let (parts, body) = match commit(resp).await {
                        Commit::Ended(r) => return r,
                        Commit::Whole(resp) => return Ok(resp),
                        Commit::Open(parts, body) => (parts, body),
                    };
                    if attempt.lease().is_some() {
                        // A hedged attempt: its commit ends the hedged call (the others are
                        // cancelled); the rest of its stream is the caller's, unreported.
                        return Ok(http::Response::from_parts(parts, Body::new(body)));
                    }
                    // The call's attempt until the stream ends: hand the stream to the caller
                    // and wait for its end, the attempt's result.
                    handoff.committed.store(true, Ordering::Release);
                    let (end, ends) = oneshot::channel();
                    *handoff.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                        Some((http::Response::from_parts(parts, Body::new(body)), end));
                    ends.await.unwrap_or_else(|_| Err(Status::cancelled("levee: the caller dropped the stream")))
                }
            });
            let result = match deadline {
                None => run.await,
                Some(at) => {
                    let mut run = std::pin::pin!(run);
                    let mut timer = std::pin::pin!(shared.clock.sleep_until(at));
                    let ended = std::future::poll_fn(|cx| {
                        if let Poll::Ready(r) = run.as_mut().poll(cx) {
                            return Poll::Ready(Some(r));
                        }
                        timer.as_mut().poll(cx).map(|()| None)
                    })
                    .await;
                    match ended {
                        Some(r) => r,
                        None => return Err(into_status(caller_deadline(&policy))),
                    }
                }
            };
            result.map_err(into_status)
        });
        ResponseFuture { call: Some(call), handoff }
    }
}

/// The error of a call whose caller's own deadline passed.
fn caller_deadline(policy: &str) -> LeveeError<Status> {
    let mut e = LeveeError::new(Reason::Deadline, policy);
    e.last = Some(Status::deadline_exceeded("the caller's deadline (grpc-timeout) passed"));
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_round_trip_and_never_grow() {
        for (d, s) in [
            (Duration::from_millis(250), "250000u"),
            (Duration::from_secs(2), "2000000u"),
            (Duration::from_nanos(7), "7n"),
            (Duration::from_secs(100_000_000), "1666666M"),
        ] {
            let v = format_timeout(d);
            assert_eq!(v.to_str().ok(), Some(s));
            assert!(parse_timeout(&v).is_some_and(|p| p <= d));
        }
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert_eq!(parse_timeout(&HeaderValue::from_static(bad)), None, "{bad:?}");
        }
        assert_eq!(parse_timeout(&HeaderValue::from_static("3M")), Some(Duration::from_secs(180)));
    }
}
