//! The durable executor's machine on [`RawEngine`] (the WIT's `executor` resource, issue 40;
//! docs/durable.md, "The executor"): every decision of the executor's loop is the core's
//! ([`levee_core::durable_exec`]); the host feeds it events and carries out its commands. One
//! host type, [`RawExecutor`], for both backends: natively the core's `Executor`, on the wasm
//! backend the component's `executor` resource, whose commands are converted to the core's
//! [`Command`] and checked on the way (an answer the WIT cannot mean is a trap).
//!
//! An executor resource lives in its component instance. When the engine's instance is
//! replaced (a trap, [`RawEngine::reinstantiate`]), the machine is made anew (same
//! configuration, the same handlers) at the next method, which answers `Err` with the trap
//! that replaced the instance: the calls the old machine held are to be abandoned by the host
//! (cancelled, forgotten); their rows are resumed once their leases lapse, as after a crash.

use levee_core::durable_exec::{self as dx, Command, Config, Event, RowWrite};
use levee_core::LoadError;

use super::{Inner, RawEngine, Trap, TrapInfo};

/// The durable executor's machine of one process, on either backend (see the module
/// documentation). Made by [`RawExecutor::new`]; its methods are `RawEngine::try_executor_*`
/// with the engine whose policies run the calls. Give it back with
/// [`RawEngine::drop_executor`] (on the wasm backend the resource is otherwise left in the
/// instance until the instance goes).
#[derive(Debug)]
pub struct RawExecutor {
    config: Config,
    handlers: Vec<String>,
    /// Handlers registered since the machine was made (registered at its next method).
    pending: Vec<String>,
    machine: Machine,
}

#[derive(Debug)]
enum Machine {
    /// Not made yet.
    None,
    /// The core's machine, made while the engine had `instance`.
    Native { m: Box<dx::Executor>, instance: u64 },
    /// The component's resource in instance `instance`.
    #[cfg(feature = "wasm")]
    Wasm { handle: wasmtime::component::ResourceAny, instance: u64 },
}

impl RawExecutor {
    /// A machine with `config` (a zero concurrency, poll or claim hold takes the core's
    /// default), made at its first method.
    pub fn new(config: Config) -> RawExecutor {
        RawExecutor { config, handlers: Vec::new(), pending: Vec::new(), machine: Machine::None }
    }

    /// The configuration given.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Let calls of handler `name` run in this process (others are quarantined).
    pub fn register(&mut self, name: &str) {
        if !self.handlers.iter().any(|h| h == name) {
            self.handlers.push(name.to_string());
            self.pending.push(name.to_string());
        }
    }

    /// Whether `name` is registered.
    pub fn is_registered(&self, name: &str) -> bool {
        self.handlers.iter().any(|h| h == name)
    }
}

impl RawEngine {
    /// The trap an executor made in a replaced instance answers: the one that replaced it.
    fn replaced(&self) -> Trap {
        self.last_trap.clone().unwrap_or_else(|| {
            Trap(Box::new(TrapInfo { operation: "executor", message: "the engine's instance was replaced".into(), restored: false }))
        })
    }

    /// Make `x`'s machine in the current instance if it has none there yet, and register the
    /// handlers it does not know. `Err`: the instance that held it was replaced (or making it
    /// trapped); the machine is new and holds no call.
    fn exec_ready(&mut self, x: &mut RawExecutor) -> Result<(), Trap> {
        let current = match &x.machine {
            Machine::None => None,
            Machine::Native { instance, .. } => Some(*instance == self.instance && matches!(self.inner, Inner::Native(_))),
            #[cfg(feature = "wasm")]
            Machine::Wasm { instance, .. } => Some(*instance == self.instance && matches!(self.inner, Inner::Wasm(_))),
        };
        if current == Some(true) {
            if x.pending.is_empty() {
                return Ok(());
            }
            let names = std::mem::take(&mut x.pending);
            return match &mut x.machine {
                Machine::Native { m, .. } => {
                    names.iter().for_each(|h| m.register(h));
                    Ok(())
                }
                #[cfg(feature = "wasm")]
                Machine::Wasm { handle, .. } => {
                    let handle = *handle;
                    let Inner::Wasm(w) = &mut self.inner else { return Err(self.replaced()) };
                    match w.executor_register(handle, &names) {
                        Ok(()) => Ok(()),
                        Err(message) => Err(self.recover("executor.register", message)),
                    }
                }
                Machine::None => Ok(()),
            };
        }
        x.pending.clear();
        x.machine = Machine::None;
        let instance = self.instance;
        match &mut self.inner {
            Inner::Native(_) => {
                let mut m = dx::Executor::new(x.config.clone());
                x.handlers.iter().for_each(|h| m.register(h));
                x.machine = Machine::Native { m: Box::new(m), instance };
            }
            #[cfg(feature = "wasm")]
            Inner::Wasm(w) => match w.executor_new(&x.config, &x.handlers) {
                Ok(handle) => x.machine = Machine::Wasm { handle, instance },
                Err(message) => return Err(self.recover("executor", message)),
            },
        }
        match current {
            Some(false) => Err(self.replaced()),
            _ => Ok(()),
        }
    }

    /// `executor.feed`: what happened at `now` (monotonic ns); the commands to carry out, in
    /// order. `Err`: the machine was lost with its instance (see the module documentation).
    pub fn try_executor_feed(&mut self, x: &mut RawExecutor, now: u64, event: Event) -> Result<Vec<Command>, Trap> {
        self.exec_ready(x)?;
        match (&mut self.inner, &mut x.machine) {
            (Inner::Native(n), Machine::Native { m, .. }) => Ok(m.feed(n, now, event)),
            #[cfg(feature = "wasm")]
            (Inner::Wasm(w), Machine::Wasm { handle, .. }) => match w.executor_feed(*handle, now, event) {
                Ok(c) => Ok(c),
                Err(message) => Err(self.recover("executor.feed", message)),
            },
            _ => Err(self.replaced()),
        }
    }

    /// `executor.forget`: forget call `id` (the host stopped its handler).
    pub fn try_executor_forget(&mut self, x: &mut RawExecutor, id: i64) -> Result<(), Trap> {
        self.exec_ready(x)?;
        match (&mut self.inner, &mut x.machine) {
            (Inner::Native(_), Machine::Native { m, .. }) => {
                m.forget(id);
                Ok(())
            }
            #[cfg(feature = "wasm")]
            (Inner::Wasm(w), Machine::Wasm { handle, .. }) => match w.executor_forget(*handle, id) {
                Ok(()) => Ok(()),
                Err(message) => Err(self.recover("executor.forget", message)),
            },
            _ => Err(self.replaced()),
        }
    }

    /// `executor.running`: the calls the machine holds.
    pub fn try_executor_running(&mut self, x: &mut RawExecutor) -> Result<u32, Trap> {
        self.exec_ready(x)?;
        match (&mut self.inner, &mut x.machine) {
            (Inner::Native(_), Machine::Native { m, .. }) => Ok(m.running().min(u32::MAX as usize) as u32),
            #[cfg(feature = "wasm")]
            (Inner::Wasm(w), Machine::Wasm { handle, .. }) => match w.executor_running(*handle) {
                Ok(n) => Ok(n),
                Err(message) => Err(self.recover("executor.running", message)),
            },
            _ => Err(self.replaced()),
        }
    }

    /// `executor.operator`: what an operator's cancel (`revive` false) or retry (`revive` true)
    /// of call `id` writes, compare-and-set against `record` (the record read), at `wall_now`.
    /// `Ok(Err)`: the call is finished already or its record is not one the core can use.
    pub fn try_executor_operator(
        &mut self,
        id: i64,
        record: &[u8],
        revive: bool,
        wall_now: u64,
    ) -> Result<Result<RowWrite, LoadError>, Trap> {
        let _ = id; // the component checks it (the native machine's row has no id)
        op!(
            self,
            "executor.operator",
            |n| dx::operator_write(if revive { n.durable_revive(record, wall_now) } else { n.durable_cancel(record, wall_now) }),
            |w| w.executor_operator(id, record, revive, wall_now)
        )
    }

    /// Give `x` back: its resource is dropped from the instance that holds it (nothing to do
    /// natively, nor for a machine whose instance was replaced).
    pub fn drop_executor(&mut self, x: RawExecutor) {
        #[cfg(feature = "wasm")]
        if let (Machine::Wasm { handle, instance }, Inner::Wasm(w)) = (&x.machine, &mut self.inner) {
            if *instance == self.instance {
                w.executor_drop(*handle);
            }
        }
        drop(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::{Backend, Limits};

    const DOC: &str = "policies:\n  p:\n    attempts: 2\n";

    fn claims(r: &Result<Vec<Command>, Trap>) -> bool {
        matches!(r.as_deref(), Ok([Command::Claim { .. }]))
    }

    #[test]
    fn a_replaced_instance_makes_the_machine_anew_and_says_so() {
        let mut backends = vec![Backend::Native];
        if cfg!(feature = "wasm") {
            backends.push(Backend::Wasm);
        }
        for backend in backends {
            let mut e = RawEngine::load_with(backend, DOC, 1, Limits::default()).unwrap();
            let mut x = RawExecutor::new(Config::new("w"));
            x.register("h");
            assert!(claims(&e.try_executor_feed(&mut x, 0, Event::Poll)), "{backend}");
            assert_eq!(e.try_executor_feed(&mut x, 1, Event::Poll), Ok(vec![]), "{backend}: one claim at a time");
            assert_eq!(e.try_executor_running(&mut x), Ok(0));
            let trap = e.reinstantiate("test", "replaced");
            assert_eq!(e.try_executor_feed(&mut x, 2, Event::Poll), Err(trap), "{backend}");
            // The new machine holds nothing and claims nothing yet.
            assert!(claims(&e.try_executor_feed(&mut x, 3, Event::Poll)), "{backend}");
            e.drop_executor(x);
        }
    }
}
