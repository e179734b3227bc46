//! What an attempt observed, in the terms of the WIT `outcome-kind`, and the mapping from
//! what Rust code returns (`std::io::Error`, `http` responses, `reqwest` responses and
//! errors). The mapping only *describes* the attempt; whether it is retried is the core's
//! decision under the policy's `retry-on` and `never-retry` rules.

use std::borrow::Cow;
use std::error::Error as StdError;

use levee_core::OutcomeKind;

/// The outcome of one attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The attempt succeeded (use `Http` for an HTTP response, even a 200).
    Success,
    /// The per-attempt timeout fired.
    Timeout,
    /// The connection could not be made or broke.
    ConnectionError,
    /// An HTTP response.
    Http {
        /// The status code.
        status: u16,
        /// The raw `Retry-After` header ("" when absent).
        retry_after: Cow<'static, str>,
        /// Whether the response carried `x-envoy-overloaded`.
        overloaded: bool,
    },
    /// A gRPC status.
    Grpc {
        /// The status code.
        code: i32,
        /// The raw `grpc-retry-pushback-ms` ("" when absent).
        pushback: Cow<'static, str>,
    },
    /// An error of a named class (matched by `error:NAME` rules).
    Error(Cow<'static, str>),
}

use crate::constants as k;

/// The cross-layer header (docs/envoy.md): every HTTP attempt a Levee host sends carries its
/// number (1 on the first). The application decides the request's retries, so a Levee filter
/// in an Envoy on the way adds none.
pub const HEADER_ATTEMPT: &str = k::HTTP_ATTEMPT_HEADER;

/// The class an error is named by in `error-class` outcomes and `error:NAME` rules
/// (docs/hosts.md, "The name of an error"). Without it, an error is named by the last path
/// segment of its type's name ([`type_class`]).
pub trait ErrorClass {
    /// The error's class name (empty: `Error`).
    fn class(&self) -> Cow<'static, str>;
}

/// The class of an error of type `E` by the naming rule: the last path segment of its
/// type's name, generics stripped (`std::io::Error` is `Error`, `my::Boom<T>` is `Boom`).
pub fn type_class<E: ?Sized>() -> &'static str {
    let full = std::any::type_name::<E>();
    let bare = full.split('<').next().unwrap_or(full);
    let last = bare.rsplit("::").next().unwrap_or(bare).trim();
    if last.is_empty() || last.starts_with("dyn ") || last.starts_with('&') || last.starts_with('(') {
        k::HTTP_UNNAMED_ERROR_CLASS
    } else {
        last
    }
}

/// An `error-class` outcome for an error named by [`ErrorClass`] (an empty name is `Error`).
pub fn class_outcome<E: ErrorClass + ?Sized>(e: &E) -> Outcome {
    let class = e.class();
    if class.is_empty() {
        Outcome::error(k::HTTP_UNNAMED_ERROR_CLASS)
    } else {
        Outcome::Error(class)
    }
}

impl Outcome {
    /// An HTTP status without headers.
    pub fn http(status: u16) -> Outcome {
        Outcome::Http { status, retry_after: Cow::Borrowed(""), overloaded: false }
    }

    /// An error class.
    pub fn error(class: impl Into<Cow<'static, str>>) -> Outcome {
        Outcome::Error(class.into())
    }

    /// The arguments of the WIT `report`: kind, code, text, flags.
    pub fn parts(&self) -> (OutcomeKind, i32, &str, u32) {
        match self {
            Outcome::Success => (OutcomeKind::Success, 0, "", 0),
            Outcome::Timeout => (OutcomeKind::Timeout, 0, "", 0),
            Outcome::ConnectionError => (OutcomeKind::ConnectionError, 0, "", 0),
            Outcome::Http { status, retry_after, overloaded } => {
                (OutcomeKind::HttpStatus, i32::from(*status), retry_after, if *overloaded { k::REPORT_OVERLOADED } else { 0 })
            }
            Outcome::Grpc { code, pushback } => (OutcomeKind::GrpcStatus, *code, pushback, 0),
            Outcome::Error(class) => (OutcomeKind::ErrorClass, 0, class, 0),
        }
    }

    /// The outcome kind's name (`success`, `timeout`, `connection-error`, `http-status`,
    /// `grpc-status`, `error-class`).
    pub fn kind_name(&self) -> &'static str {
        k::OUTCOME_KINDS.get(self.parts().0 as usize).copied().unwrap_or("error-class")
    }

    /// Whether this is `Success` (the only outcome whose report may be held back).
    pub fn is_plain_success(&self) -> bool {
        matches!(self, Outcome::Success)
    }
}

/// Describe a value or an error as an attempt's outcome.
pub trait IntoOutcome {
    /// The outcome this value stands for.
    fn outcome(&self) -> Outcome;
}

impl IntoOutcome for Outcome {
    fn outcome(&self) -> Outcome {
        self.clone()
    }
}

impl IntoOutcome for std::io::Error {
    fn outcome(&self) -> Outcome {
        io_outcome(self.kind())
    }
}

impl IntoOutcome for Box<dyn StdError + Send + Sync> {
    fn outcome(&self) -> Outcome {
        chain_outcome(self.as_ref()).unwrap_or_else(|| Outcome::error(k::HTTP_UNNAMED_ERROR_CLASS))
    }
}

fn io_outcome(kind: std::io::ErrorKind) -> Outcome {
    use std::io::ErrorKind as K;
    match kind {
        K::TimedOut => Outcome::Timeout,
        K::ConnectionRefused
        | K::ConnectionReset
        | K::ConnectionAborted
        | K::NotConnected
        | K::AddrNotAvailable
        | K::BrokenPipe
        | K::UnexpectedEof
        | K::HostUnreachable
        | K::NetworkUnreachable
        | K::NetworkDown => Outcome::ConnectionError,
        // By the naming rule: the type's name, `std::io::Error`.
        _ => Outcome::error(k::HTTP_UNNAMED_ERROR_CLASS),
    }
}

/// The outcome of the first error in a source chain that says what happened: an I/O error, or
/// an elapsed timer (tokio's `Elapsed`).
pub fn chain_outcome(e: &(dyn StdError + 'static)) -> Option<Outcome> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io_outcome(io.kind()));
        }
        #[cfg(feature = "tokio")]
        if err.is::<tokio::time::error::Elapsed>() {
            return Some(Outcome::Timeout);
        }
        #[cfg(feature = "reqwest")]
        if let Some(r) = err.downcast_ref::<reqwest::Error>() {
            return Some(r.outcome());
        }
        cur = err.source();
    }
    None
}

#[cfg(feature = "http")]
mod http_impls {
    use std::borrow::Cow;

    use super::{IntoOutcome, Outcome};
    use crate::constants as k;

    /// The outcome of an HTTP response head: its status, raw `Retry-After` and
    /// `x-envoy-overloaded`.
    pub fn response_outcome(status: http::StatusCode, headers: &http::HeaderMap) -> Outcome {
        let retry_after = headers
            .get(http::header::RETRY_AFTER)
            .map(|v| Cow::Owned(String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .unwrap_or(Cow::Borrowed(""));
        Outcome::Http { status: status.as_u16(), retry_after, overloaded: headers.contains_key("x-envoy-overloaded") }
    }

    impl<B> IntoOutcome for http::Response<B> {
        fn outcome(&self) -> Outcome {
            response_outcome(self.status(), self.headers())
        }
    }

    /// The `start` flags for an HTTP method (bits 8-11, see the WIT), case-sensitive as RFC
    /// 9110 is: the registered tokens of the generated `METHODS` table, any other (`get` in
    /// lower case too) `other`.
    pub fn method_flags(method: &http::Method) -> u32 {
        let m = method.as_str();
        let code = k::METHODS.iter().find(|(name, _)| *name == m).map_or(k::METHOD_OTHER, |(_, c)| *c);
        code << k::START_METHOD_SHIFT
    }

    /// The request headers that carry an idempotency key (as every Levee host reads them):
    /// a request with a non-empty one may be retried whatever its method.
    pub const IDEMPOTENCY_KEY_HEADERS: [&str; 2] = k::IDEMPOTENCY_HEADERS;

    /// The key of an HTTP call (docs/hosts.md, "The key of an HTTP call"): `host:port`, the
    /// host lower-cased, an IPv6 literal in brackets, no userinfo, the port always written
    /// (the scheme's default when the URL has none); `""` for a URI without a host.
    pub fn http_key(uri: &http::Uri) -> String {
        let Some(host) = uri.host() else { return String::new() };
        let host = host.to_ascii_lowercase();
        let port = uri.port_u16().or_else(|| {
            let scheme = uri.scheme_str().unwrap_or("http").to_ascii_lowercase();
            k::DEFAULT_PORTS.iter().find(|(s, _)| *s == scheme).map(|(_, p)| *p)
        });
        let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
        match port {
            Some(p) => format!("{host}:{p}"),
            None => host,
        }
    }

    /// The `start` flags of an HTTP request: its method, and bit 1 when it carries an
    /// idempotency key ([`IDEMPOTENCY_KEY_HEADERS`]).
    pub fn request_flags(method: &http::Method, headers: &http::HeaderMap) -> u32 {
        let keyed = IDEMPOTENCY_KEY_HEADERS.iter().any(|h| headers.get_all(*h).iter().any(|v| !v.as_bytes().is_empty()));
        method_flags(method) | if keyed { k::START_IDEMPOTENCY_KEY } else { 0 }
    }
}

#[cfg(feature = "http")]
pub use http_impls::{http_key, method_flags, request_flags, response_outcome, IDEMPOTENCY_KEY_HEADERS};

#[cfg(feature = "reqwest")]
mod reqwest_impls {
    use super::{chain_outcome, response_outcome, IntoOutcome, Outcome};

    impl IntoOutcome for reqwest::Response {
        fn outcome(&self) -> Outcome {
            response_outcome(self.status(), self.headers())
        }
    }

    impl IntoOutcome for reqwest::Error {
        fn outcome(&self) -> Outcome {
            // A connect timeout is a connection error (docs/hosts.md, "Outcomes of errors").
            if self.is_connect() {
                return Outcome::ConnectionError;
            }
            if self.is_timeout() {
                return Outcome::Timeout;
            }
            if let Some(status) = self.status() {
                return Outcome::http(status.as_u16());
            }
            if let Some(o) = std::error::Error::source(self).and_then(chain_outcome) {
                return o;
            }
            // A request that failed on the wire after connecting (a reset, a closed
            // connection) is a connection error; a body or decode error is the caller's own.
            if self.is_request() {
                return Outcome::ConnectionError;
            }
            // By the naming rule: the type's name, `reqwest::Error`.
            Outcome::error(crate::outcome::type_class::<reqwest::Error>())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_to_kinds() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(refused.outcome(), Outcome::ConnectionError);
        assert_eq!(std::io::Error::from(std::io::ErrorKind::TimedOut).outcome(), Outcome::Timeout);
        assert_eq!(std::io::Error::from(std::io::ErrorKind::InvalidData).outcome(), Outcome::error("Error"));
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(refused);
        assert_eq!(boxed.outcome(), Outcome::ConnectionError);
    }

    #[test]
    fn errors_are_named_by_their_type() {
        struct Boom<T>(T);
        assert_eq!(type_class::<Boom<u8>>(), "Boom");
        assert_eq!(type_class::<std::io::Error>(), "Error");
        assert_eq!(type_class::<dyn StdError>(), "Error");
        let _ = Boom(0u8).0;
    }

    #[cfg(feature = "http")]
    #[test]
    fn http_keys_follow_the_rule() {
        let key = |u: &str| http_key(&u.parse().unwrap_or_default());
        assert_eq!(key("https://API.example.com/a"), "api.example.com:443");
        assert_eq!(key("https://api.example.com:443/b"), "api.example.com:443");
        assert_eq!(key("http://user:pw@h:8080/"), "h:8080");
        assert_eq!(key("http://[::1]/"), "[::1]:80");
        assert_eq!(method_flags(&http::Method::from_bytes(b"get").unwrap_or_default()), k::METHOD_OTHER << 8);
        assert_eq!(method_flags(&http::Method::GET), k::METHOD_GET << 8);
    }

    #[test]
    fn parts_follow_the_wit() {
        let o = Outcome::Http { status: 429, retry_after: Cow::Borrowed("3"), overloaded: true };
        assert_eq!(o.parts(), (OutcomeKind::HttpStatus, 429, "3", 1));
        assert_eq!(Outcome::error("Throttled").parts(), (OutcomeKind::ErrorClass, 0, "Throttled", 0));
    }
}
