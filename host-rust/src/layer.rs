//! A `tower::Layer` that runs every `http` request of a service under a Levee policy.
//!
//! The request body must be `Clone` (each attempt sends a copy; mark a request whose body a
//! copy cannot replay with the [`OneShot`] extension); the key of each call is the request's
//! origin (`host:port`, docs/hosts.md), so every downstream has its own breaker, limiter and
//! budget. The method and a non-empty `Idempotency-Key` or `X-Idempotency-Key` header go in
//! the `start` flags (a keyed request is retried whatever its method). Responses are described by status, `Retry-After` and `x-envoy-overloaded`; the
//! service's errors by [`IntoOutcome`]. A response the policy does not retry further (say a
//! last 503) is returned as it is; a call the policy refuses, or whose last attempt failed
//! with an error, is a [`LeveeError`]. Every attempt carries `x-levee-attempt: N`
//! ([`crate::outcome::HEADER_ATTEMPT`]; docs/envoy.md), and the [`crate::Attempt`] in its
//! extensions.

use std::sync::Arc;
use std::task::{Context, Poll};

use crate::call::BoxFuture;
use crate::outcome::{request_flags, IntoOutcome, Outcome};
use crate::{Levee, LeveeError, RetryIf, UnknownPolicy};

/// A request extension: this request's body cannot be replayed (its clones do not send the
/// same bytes again, say a body fed from a channel). The request is then started not
/// idempotent and without the idempotency-key flag (docs/hosts.md, "Idempotency"), so the
/// core never asks for a second attempt.
#[derive(Clone, Copy, Debug, Default)]
pub struct OneShot;

/// Wraps services in [`LeveeService`].
#[derive(Clone)]
pub struct LeveeLayer {
    levee: Levee,
    policy: Arc<str>,
    key: Option<Arc<str>>,
    retry_if: Option<RetryIf>,
}

impl std::fmt::Debug for LeveeLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeveeLayer")
            .field("policy", &self.policy)
            .field("key", &self.key)
            .field("retry_if", &self.retry_if.is_some())
            .finish()
    }
}

impl LeveeLayer {
    /// Run requests under the named policy of `levee`. A name the document does not have is
    /// an [`UnknownPolicy`] error (listing the names it has).
    pub fn new(levee: Levee, policy: &str) -> Result<Self, UnknownPolicy> {
        levee.policy(policy)?;
        Ok(LeveeLayer { levee, policy: Arc::from(policy), key: None, retry_if: None })
    }

    /// Use one fixed key instead of each request's authority.
    pub fn with_key(mut self, key: &str) -> Self {
        self.key = Some(Arc::from(key));
        self
    }

    /// The retry predicate of every request through this layer (docs/hosts.md, section 9; it
    /// wins over the policy's): called once per attempt with the response
    /// ([`crate::Attempted::value`] as an `http::Response<B>`) or the service's error;
    /// `Some(true)` asks for a retry, `Some(false)` refuses one, `None` leaves it to the policy.
    pub fn retry_if(mut self, f: impl Fn(&crate::Attempted<'_>) -> Option<bool> + Send + Sync + 'static) -> Self {
        self.retry_if = Some(Arc::new(f));
        self
    }

    /// This layer for a tonic channel (feature `grpc`): the same policy, key and predicate,
    /// with gRPC's semantics ([`crate::grpc`]).
    #[cfg(feature = "grpc")]
    pub fn grpc(self) -> crate::grpc::GrpcLayer {
        crate::grpc::GrpcLayer::from_layer(self.levee, self.policy, self.key, self.retry_if)
    }
}

impl<S> tower_layer::Layer<S> for LeveeLayer {
    type Service = LeveeService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LeveeService {
            inner,
            levee: self.levee.clone(),
            policy: self.policy.clone(),
            key: self.key.clone(),
            retry_if: self.retry_if.clone(),
        }
    }
}

/// A service whose requests run under a Levee policy.
#[derive(Clone)]
pub struct LeveeService<S> {
    inner: S,
    levee: Levee,
    policy: Arc<str>,
    key: Option<Arc<str>>,
    retry_if: Option<RetryIf>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for LeveeService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeveeService")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

fn copy_request<B: Clone>(r: &http::Request<B>) -> http::Request<B> {
    let mut out = http::Request::new(r.body().clone());
    *out.method_mut() = r.method().clone();
    *out.uri_mut() = r.uri().clone();
    *out.version_mut() = r.version();
    *out.headers_mut() = r.headers().clone();
    *out.extensions_mut() = r.extensions().clone();
    out
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for LeveeService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: IntoOutcome + Send + 'static,
    B: Clone + Send + Sync + 'static,
    RB: Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = LeveeError<S::Error>;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is awaited per attempt, on a clone of the inner service.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let levee = self.levee.clone();
        let policy = self.policy.clone();
        let inner = self.inner.clone();
        let retry_if = self.retry_if.clone();
        let key = match &self.key {
            Some(k) => k.to_string(),
            None => crate::outcome::http_key(req.uri()),
        };
        let flags = if req.extensions().get::<OneShot>().is_some() {
            // A body that cannot be sent twice: not idempotent, whatever its headers say.
            (request_flags(req.method(), req.headers()) & !crate::constants::START_IDEMPOTENCY_KEY) | crate::constants::START_NON_IDEMPOTENT
        } else {
            request_flags(req.method(), req.headers())
        };
        let faults = req.extensions().get::<crate::FaultPlan>().cloned().unwrap_or_default();
        Box::pin(async move {
            levee
                .call(&policy)
                .key(key)
                .flags(flags)
                .http()
                .faults(&faults)
                .retry_if_shared(retry_if)
                .run_classified(
                    |r: &Result<http::Response<RB>, S::Error>| match r {
                        Ok(resp) => resp.outcome(),
                        Err(e) => e.outcome(),
                    },
                    move |attempt| {
                        let mut svc = inner.clone();
                        let mut req = copy_request(&req);
                        req.headers_mut().insert(crate::outcome::HEADER_ATTEMPT, http::HeaderValue::from(attempt.number));
                        // The attempt itself (number, timeout, degraded) for the services below.
                        req.extensions_mut().insert(attempt);
                        async move {
                            std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
                            svc.call(req).await
                        }
                    },
                )
                .await
        })
    }
}

impl IntoOutcome for std::convert::Infallible {
    fn outcome(&self) -> Outcome {
        match *self {}
    }
}
