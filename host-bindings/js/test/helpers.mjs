// Test helpers: a scripted HTTP server on 127.0.0.1.

import { createServer } from 'node:http';

/**
 * A server whose answers are scripted per path: `script(path, [step, ...])`; each request takes the
 * next step, the last one repeats. A step is `{ status, headers?, body?, delay? }` (delay in ms).
 */
export async function scriptedServer() {
  const routes = new Map();
  const log = [];
  const server = createServer((req, res) => {
    const entry = { path: req.url, method: req.method, at: performance.now(), aborted: false, headers: req.headers };
    log.push(entry);
    req.resume();
    const queue = routes.get(req.url);
    const step = queue === undefined ? undefined : queue.length > 1 ? queue.shift() : queue[0];
    if (step === undefined) {
      res.writeHead(404).end('no script');
      return;
    }
    const answer = () => {
      if (res.destroyed) return;
      res.writeHead(step.status, step.headers ?? {});
      res.end(step.body ?? `status ${step.status}`);
    };
    if (step.delay) {
      const timer = setTimeout(answer, step.delay);
      res.on('close', () => {
        if (!res.writableFinished) entry.aborted = true;
        clearTimeout(timer);
      });
    } else {
      answer();
    }
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address();
  return {
    url: (path) => `http://127.0.0.1:${port}${path}`,
    host: `127.0.0.1:${port}`,
    script: (path, steps) => routes.set(path, [...steps]),
    requests: (path) => log.filter((e) => e.path === path),
    close: () =>
      new Promise((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

/** Collect every event a Levee emits. */
export function recordEvents(levee) {
  const events = [];
  levee.on('event', (e) => events.push(e));
  return events;
}
