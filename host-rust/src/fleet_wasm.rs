// The `fleet-*` functions through the component (included in `raw::wasm`, which owns the
// instance). The bytes are bounded work: each crossing gets the ticks of the bytes it walks.

impl Instance {
    pub(crate) fn fleet_plan(&mut self, policy: u32) -> Result<Option<String>, String> {
        call!(self, call_ticks, call_fleet_plan(policy))
    }

    pub(crate) fn fleet_merge(
        &mut self,
        policy: u32,
        key: &str,
        node: &str,
        now: u64,
        wall_ms: u64,
        shared: &[u8],
    ) -> Result<Result<Vec<u8>, LoadError>, String> {
        Ok(call!(self, work(shared.len()), call_fleet_merge(policy, key, node, now, wall_ms, shared))?.map_err(load_error))
    }

    pub(crate) fn fleet_apply(
        &mut self,
        policy: u32,
        key: &str,
        node: &str,
        now: u64,
        wall_ms: u64,
        shared: &[u8],
    ) -> Result<Result<(), LoadError>, String> {
        Ok(call!(self, work(shared.len()), call_fleet_apply(policy, key, node, now, wall_ms, shared))?.map_err(load_error))
    }

    pub(crate) fn fleet_inspect(&mut self, shared: &[u8]) -> Result<Result<String, LoadError>, String> {
        Ok(call!(self, work(shared.len()), call_fleet_inspect(shared))?.map_err(load_error))
    }
}
