//! `reqwest` integration: a client wrapper ([`Client`]) and a `reqwest-middleware`
//! middleware ([`Middleware`]).
//!
//! Each request is one call under the policy, keyed by the URL's `host:port`, with its
//! method in the `start` flags (the policy's `idempotent-methods` decide what may be
//! retried). Every attempt sends a copy (`Request::try_clone`); a request whose body cannot
//! be copied (a stream) is marked not idempotent, so the core never asks for a retry.
//! Responses are described by status, raw `Retry-After` (seconds or an HTTP-date, parsed by
//! the core) and `x-envoy-overloaded`; errors by kind (timeout, connect, ...). The last
//! response is returned as it is when the policy stops (as reqwest returns a 503); a refusal
//! or a final error is a [`LeveeError`].
//!
//! Every attempt carries `x-levee-attempt: N` (1 on the first): the application decides this
//! request's retries, so a Levee filter in an Envoy on the way adds none (docs/envoy.md).

use crate::outcome::{chain_outcome, method_flags, IntoOutcome, Outcome};
use crate::{Levee, LeveeError};

pub use crate::outcome::HEADER_ATTEMPT;

fn key_of(url: &::reqwest::Url) -> String {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_string(),
        _ => String::new(),
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
    /// Wrap `client`: its requests run under the named policy of `levee`.
    pub fn new(client: ::reqwest::Client, levee: Levee, policy: &str) -> Self {
        Client { client, levee, policy: policy.to_string() }
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

    /// Build and execute a request.
    pub async fn send(&self, builder: ::reqwest::RequestBuilder) -> Result<::reqwest::Response, LeveeError<::reqwest::Error>> {
        let req = builder.build().map_err(|e| {
            let mut err = LeveeError::new(levee_core::Reason::NonRetryable, &self.policy);
            err.last = Some(e);
            err
        })?;
        self.execute(req).await
    }

    /// Execute a request under the policy.
    pub async fn execute(&self, req: ::reqwest::Request) -> Result<::reqwest::Response, LeveeError<::reqwest::Error>> {
        let key = key_of(req.url());
        let mut flags = method_flags(req.method());
        let mut sender = Sender::new(req);
        if sender.single.is_some() {
            flags |= 1;
        }
        let client = &self.client;
        let r = self
            .levee
            .call(&self.policy)
            .key(key)
            .flags(flags)
            .run_classified(
                |r: &Result<::reqwest::Response, AttemptError>| match r {
                    Ok(resp) => resp.outcome(),
                    Err(e) => e.outcome(),
                },
                |attempt| {
                    let req = sender.next(attempt.number);
                    async move {
                        match req {
                            Some(req) => client.execute(req).await.map_err(|e| AttemptError(Some(e))),
                            None => Err(AttemptError(None)),
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
            out.invalid = e.invalid;
            out.last = e.last.and_then(|a| a.0);
            out.fallback_error = e.fallback_error.and_then(|a| a.0);
            out
        })
    }
}

/// Copies of a request, one per attempt; a request whose body cannot be copied goes once.
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
/// stream already sent).
#[derive(Debug)]
struct AttemptError(Option<::reqwest::Error>);

impl IntoOutcome for AttemptError {
    fn outcome(&self) -> Outcome {
        match &self.0 {
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
    /// Run requests under the named policy of `levee`.
    pub fn new(levee: Levee, policy: &str) -> Self {
        Middleware { levee, policy: policy.to_string() }
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
        let mut flags = method_flags(req.method());
        let mut sender = Sender::new(req);
        if sender.single.is_some() {
            flags |= 1;
        }
        let ext = extensions.clone();
        let r = self
            .levee
            .call(&self.policy)
            .key(key)
            .flags(flags)
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
                            Some(req) => next.run(req, &mut ext).await,
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
