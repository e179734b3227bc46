//! A diagnostic for the filter's latency benchmark (proxy-wasm/bench, `--compare`): a
//! proxy-wasm filter that makes the levee filter's host calls per forwarded request (the same
//! 12: header maps, `xds.cluster_name`, the clock, a shared-data read and CAS write each way,
//! three request headers set) with none of its work. What it adds over the passthrough is the
//! price of those calls alone; what the levee filter adds over it is its own Wasm work.
//!
//! `cargo build --release --target wasm32-wasip1 -p levee-proxy-wasm --example hostcalls`

#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)] // the ABI's exported entry point (`#[no_mangle] _initialize`)
mod entry {
    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, MapType};

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;
    impl Context for Root {}
    impl RootContext for Root {
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Calls))
        }
        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    /// About the size of the benchmark policy's key state (a 100-entry breaker window).
    const STATE: [u8; 128] = [1; 128];

    /// A shared-data read and a write with the version read, as the levee filter does.
    fn shared() {
        if let Ok((_, cas)) = hostcalls::get_shared_data("hostcalls:key") {
            let _ = hostcalls::set_shared_data("hostcalls:key", Some(&STATE), cas);
        }
    }

    struct Calls;
    impl Context for Calls {}
    impl HttpContext for Calls {
        fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            let _ = hostcalls::get_map_bytes(MapType::HttpRequestHeaders);
            let _ = hostcalls::get_property(vec!["xds", "cluster_name"]);
            let _ = hostcalls::get_current_time();
            shared();
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-envoy-max-retries", Some("2"));
            let _ = hostcalls::set_map_value(
                MapType::HttpRequestHeaders,
                "x-envoy-retry-on",
                Some("connect-failure,refused-stream,reset,retriable-status-codes"),
            );
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-envoy-retriable-status-codes", Some("503"));
            Action::Continue
        }
        fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            let _ = hostcalls::get_map_bytes(MapType::HttpResponseHeaders);
            let _ = hostcalls::get_current_time();
            shared();
            Action::Continue
        }
    }
}
