//! The baseline of the filter's latency benchmark (proxy-wasm/bench): a proxy-wasm HTTP filter
//! that does nothing, run by the same Envoy, in the same V8 runtime, on the same listener
//! shape as the levee filter. What it adds over the router alone is the price of Envoy's Wasm
//! machinery (a VM context per request, the ABI's callbacks); what the levee filter adds over
//! it is the levee filter's own.
//!
//! `cargo build --release --target wasm32-wasip1 -p levee-proxy-wasm --example passthrough`

#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)] // the ABI's exported entry point (`#[no_mangle] _initialize`)
mod entry {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType};

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;
    impl Context for Root {}
    impl RootContext for Root {
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Pass))
        }
        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    /// Reads one request header, as any filter must to do anything, and lets the request on.
    struct Pass;
    impl Context for Pass {}
    impl HttpContext for Pass {
        fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            let _ = self.get_http_request_header(":authority");
            Action::Continue
        }
        fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            let _ = self.get_http_response_header(":status");
            Action::Continue
        }
    }
}
