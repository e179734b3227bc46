//! `reqwest` integration: a client wrapper ([`Client`]) and a `reqwest-middleware`
//! middleware ([`Middleware`]).
//!
//! Each request is one call under the policy, keyed by the URL's origin as `host:port`
//! (docs/hosts.md: the host lower-cased, the port always written), with its
//! method in the `start` flags (the policy's `idempotent-methods` decide what may be
//! retried) and, when it carries a non-empty `Idempotency-Key` or `X-Idempotency-Key`
//! header, the "has an idempotency key" flag (the core then retries it whatever its method).
//! Every attempt sends a copy (`Request::try_clone`); a request whose body cannot be copied
//! (a stream) is started not idempotent and without the idempotency-key flag, whatever its
//! headers say (docs/hosts.md, "Idempotency"): the core never asks for a second attempt, and
//! a retryable failure ends it with `non-idempotent` (the response itself is returned).
//!
//! The policy's fallback chain runs fallbacks registered with [`Levee::register_fallback`]
//! for `Result<reqwest::Response, reqwest::Error>` (the [`Middleware`] also runs those
//! registered for `Result<reqwest::Response, reqwest_middleware::Error>`).
//!
//! Naming a policy the document does not have fails when the client or middleware is built
//! ([`UnknownPolicy`], with the document's names).
//! Responses are described by status, raw `Retry-After` (seconds or an HTTP-date, parsed by
//! the core) and `x-envoy-overloaded`; errors by kind (timeout, connect, ...). The last
//! response is returned as it is when the policy stops (as reqwest returns a 503); a refusal
//! or a final error is a [`LeveeError`].
//!
//! Every attempt carries `x-levee-attempt: N` (1 on the first): the application decides this
//! request's retries, so a Levee filter in an Envoy on the way adds none (docs/envoy.md).

use std::future::Future;

use crate::outcome::{chain_outcome, request_flags, IntoOutcome, Outcome};
use crate::{Call, FallbackContext, Levee, LeveeError, UnknownPolicy};

/// The `start` flags of a request: a body that cannot be sent twice (`replayable` false)
/// makes it not idempotent, and an idempotency key cannot change that.
fn flags_of(req: &::reqwest::Request, replayable: bool) -> u32 {
    let flags = request_flags(req.method(), req.headers());
    if replayable {
        flags
    } else {
        (flags & !2) | 1
    }
}

/// Add to `call` the fallbacks of the policy's chain registered for
/// `Result<reqwest::Response, reqwest::Error>`, with their errors mapped by `wrap` (the call
/// itself runs with another error type). Looked up per call: a reload may change the chain
/// and fallbacks may be registered at any time.
fn with_reqwest_fallbacks<'a, E: Send + 'static>(
    levee: &Levee,
    policy: &str,
    mut call: Call<'a, ::reqwest::Response, E>,
    wrap: fn(::reqwest::Error) -> E,
) -> Call<'a, ::reqwest::Response, E> {
    let Some(info) = levee.policy_info(policy) else {
        return call;
    };
    for name in &info.fallbacks {
        if let Some(f) = levee.registered_fallback::<::reqwest::Response, ::reqwest::Error>(name) {
            call = call.fallback(name, move |ctx: FallbackContext| adapt(f(ctx), wrap));
        }
    }
    call
}

async fn adapt<E>(
    fut: impl Future<Output = Result<::reqwest::Response, ::reqwest::Error>>,
    wrap: fn(::reqwest::Error) -> E,
) -> Result<::reqwest::Response, E> {
    fut.await.map_err(wrap)
}

pub use crate::outcome::HEADER_ATTEMPT;

/// The key of a request: its origin as `host:port` (docs/hosts.md, "The key of an HTTP
/// call"; `Url` lower-cases the host, keeps IPv6 brackets and drops nothing else we need).
fn key_of(url: &::reqwest::Url) -> String {
    match url.as_str().parse::<http::Uri>() {
        Ok(uri) => crate::outcome::http_key(&uri),
        Err(_) => String::new(),
    }
}

/// A `reqwest::Client` whose requests run under a Levee policy.
#[derive(Clone, Debug)]
pub struct Client {
    client: ::reqwest::Client,
    levee: Levee,
    policy: String,
}

impl Client {
    /// Wrap `client`: its requests run under the named policy of `levee`. A name the
    /// document does not have is an [`UnknownPolicy`] error (listing the names it has).
    pub fn new(client: ::reqwest::Client, levee: Levee, policy: &str) -> Result<Self, UnknownPolicy> {
        levee.policy(policy)?;
        Ok(Client { client, levee, policy: policy.to_string() })
    }

    /// The inner client (to build requests).
    pub fn inner(&self) -> &::reqwest::Client {
        &self.client
    }

    /// A GET request builder of the inner client; send it with [`Client::send`].
    pub fn get(&self, url: impl ::reqwest::IntoUrl) -> ::reqwest::RequestBuilder {
        self.client.get(url)
    }

    /// A POST request builder of the inner client; send it with [`Client::send`].
    pub fn post(&self, url: impl ::reqwest::IntoUrl) -> ::reqwest::RequestBuilder {
        self.client.post(url)
    }

    /// Build and execute a request. A request that cannot be built never reaches the core
    /// (docs/hosts.md, section 5): its error comes back as `last` of a [`LeveeError`] whose
    /// `reason` is `none` and `attempts` 0 (no reason is made up for it).
    pub async fn send(&self, builder: ::reqwest::RequestBuilder) -> Result<::reqwest::Response, LeveeError<::reqwest::Error>> {
        let req = builder.build().map_err(|e| {
            let mut err = LeveeError::new(levee_core::Reason::None, &self.policy);
            err.last = Some(e);
            err
        })?;
        self.execute(req).await
    }

    /// Execute a request under the policy.
    pub async fn execute(&self, req: ::reqwest::Request) -> Result<::reqwest::Response, LeveeError<::reqwest::Error>> {
        let key = key_of(req.url());
        let mut sender = Sender::new(req);
        let flags = sender.flags();
        let client = &self.client;
        let call = self.levee.call(&self.policy).key(key).flags(flags).http();
        let r = with_reqwest_fallbacks(&self.levee, &self.policy, call, |e| AttemptError(Some(e), false))
            .run_classified(
                |r: &Result<::reqwest::Response, AttemptError>| match r {
                    Ok(resp) => resp.outcome(),
                    Err(e) => e.outcome(),
                },
                |attempt| {
                    let req = sender.next(attempt.number);
                    async move {
                        match req {
                            Some(req) => match client.execute(req).await {
                                Ok(resp) => whole(resp).await.map_err(|e| AttemptError(Some(e), true)),
                                Err(e) => Err(AttemptError(Some(e), false)),
                            },
                            None => Err(AttemptError(None, false)),
                        }
                    }
                },
            )
            .await;
        r.map_err(|e| {
            let mut out = LeveeError::new(e.reason, &e.policy);
            out.attempts = e.attempts;
            out.retry_after = e.retry_after;
            out.trap = e.trap;
            out.fault = e.fault;
            out.invalid = e.invalid;
            out.known_policies = e.known_policies;
            out.unregistered = e.unregistered;
            // The call runs with an error type of its own: its fallbacks are the reqwest ones.
            out.mistyped = e
                .mistyped
                .into_iter()
                .map(|mut m| {
                    m.call = crate::error::result_name::<::reqwest::Response, ::reqwest::Error>();
                    m
                })
                .collect();
            out.last = e.last.and_then(|a| a.0);
            out.outcome = e.outcome;
            out.fallback_error = e.fallback_error.and_then(|a| a.0);
            out
        })
    }
}

/// Copies of a request, one per attempt; a request whose body cannot be copied goes once.
/// An attempt is the whole response (`docs/http.md`): the body is read inside the attempt,
/// under its timeout, so a body that trickles past it is a timeout and a connection closed
/// mid-body a connection error of that attempt. The response handed back has its body in
/// memory (status, version, headers and URL kept).
async fn whole(resp: ::reqwest::Response) -> Result<::reqwest::Response, ::reqwest::Error> {
    use ::reqwest::ResponseBuilderExt;
    let (status, version, url, headers) = (resp.status(), resp.version(), resp.url().clone(), resp.headers().clone());
    let body = resp.bytes().await?;
    let mut builder = http::Response::builder().status(status).version(version).url(url);
    if let Some(h) = builder.headers_mut() {
        *h = headers.clone();
    }
    let rebuilt = builder.body(body.clone()).unwrap_or_else(|_| {
        // Parts of a response reqwest accepted are valid; keep status and headers regardless.
        let mut r = http::Response::new(body);
        *r.status_mut() = status;
        *r.headers_mut() = headers;
        r
    });
    Ok(::reqwest::Response::from(rebuilt))
}

struct Sender {
    template: Option<::reqwest::Request>,
    single: Option<::reqwest::Request>,
}

impl Sender {
    fn new(req: ::reqwest::Request) -> Self {
        if req.try_clone().is_some() {
            Sender { template: Some(req), single: None }
        } else {
            Sender { template: None, single: Some(req) }
        }
    }

    /// The `start` flags of the request.
    fn flags(&self) -> u32 {
        match (&self.template, &self.single) {
            (Some(t), _) => flags_of(t, true),
            (None, Some(s)) => flags_of(s, false),
            (None, None) => 1,
        }
    }

    /// The request for attempt `number`, marked with it.
    fn next(&mut self, number: u32) -> Option<::reqwest::Request> {
        let mut req = match &self.template {
            Some(t) => t.try_clone(),
            None => self.single.take(),
        }?;
        req.headers_mut().insert(HEADER_ATTEMPT, ::reqwest::header::HeaderValue::from(number));
        Some(req)
    }
}

/// An attempt's error: `None` when the request could not be sent again (its body was a
/// stream already sent); `.1`: it broke off while the body was read.
#[derive(Debug)]
struct AttemptError(Option<::reqwest::Error>, bool);

impl IntoOutcome for AttemptError {
    fn outcome(&self) -> Outcome {
        match &self.0 {
            // A body that breaks off is a connection error of the attempt (docs/http.md).
            Some(e) if self.1 && !e.is_timeout() => Outcome::ConnectionError,
            Some(e) => e.outcome(),
            None => Outcome::error("levee:body-not-replayable"),
        }
    }
}

/// A `reqwest-middleware` middleware running each request under a Levee policy.
///
/// Extensions are copied into each attempt; changes later middlewares make to them are not
/// carried back.
#[derive(Clone, Debug)]
pub struct Middleware {
    levee: Levee,
    policy: String,
}

impl Middleware {
    /// Run requests under the named policy of `levee`. A name the document does not have is
    /// an [`UnknownPolicy`] error (listing the names it has).
    pub fn new(levee: Levee, policy: &str) -> Result<Self, UnknownPolicy> {
        levee.policy(policy)?;
        Ok(Middleware { levee, policy: policy.to_string() })
    }
}

impl IntoOutcome for reqwest_middleware::Error {
    fn outcome(&self) -> Outcome {
        match self {
            reqwest_middleware::Error::Reqwest(e) => e.outcome(),
            reqwest_middleware::Error::Middleware(e) => chain_outcome(e.as_ref()).unwrap_or_else(|| Outcome::error("middleware")),
        }
    }
}

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for Middleware {
    async fn handle(
        &self,
        req: ::reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<::reqwest::Response> {
        let key = key_of(req.url());
        let mut sender = Sender::new(req);
        let flags = sender.flags();
        let ext = extensions.clone();
        let call = self.levee.call(&self.policy).key(key).flags(flags).http();
        let r = with_reqwest_fallbacks(&self.levee, &self.policy, call, reqwest_middleware::Error::Reqwest)
            .run_classified(
                |r: &reqwest_middleware::Result<::reqwest::Response>| match r {
                    Ok(resp) => resp.outcome(),
                    Err(e) => e.outcome(),
                },
                |attempt| {
                    let next = next.clone();
                    let mut ext = ext.clone();
                    let req = sender.next(attempt.number);
                    async move {
                        match req {
                            Some(req) => match next.run(req, &mut ext).await {
                                // The body is part of the attempt (docs/http.md); one that breaks
                                // off is a connection error of this attempt.
                                Ok(resp) => whole(resp).await.map_err(|e| {
                                    if e.is_timeout() {
                                        reqwest_middleware::Error::Reqwest(e)
                                    } else {
                                        reqwest_middleware::Error::middleware(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, e))
                                    }
                                }),
                                Err(e) => Err(e),
                            },
                            None => Err(reqwest_middleware::Error::middleware(NoBody)),
                        }
                    }
                },
            )
            .await;
        // A refusal, or a last attempt that failed with an error, is a `LeveeError` inside
        // `Error::Middleware`: downcast it to `LeveeError<reqwest_middleware::Error>`.
        r.map_err(reqwest_middleware::Error::middleware)
    }
}

#[derive(Debug)]
struct NoBody;

impl std::fmt::Display for NoBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body cannot be sent twice")
    }
}

impl std::error::Error for NoBody {}
