// Test helpers: a scripted HTTP server on 127.0.0.1, a free port there.

import { createServer } from 'node:http';
import { createServer as createNetServer } from 'node:net';

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
    entry.received = '';
    req.setEncoding('utf8');
    req.on('data', (chunk) => (entry.received += chunk));
    const queue = routes.get(req.url);
    const step = queue === undefined ? undefined : queue.length > 1 ? queue.shift() : queue[0];
    if (step === undefined) {
      res.writeHead(404).end('no script');
      return;
    }
    const answer = () => {
      if (res.destroyed) return;
      const body = step.body ?? `status ${step.status}`;
      if (step.cut) {
        // Headers and half the body, then the connection closes.
        res.writeHead(step.status, { ...(step.headers ?? {}), 'content-length': String(body.length) });
        res.write(body.slice(0, body.length >> 1), () => setTimeout(() => res.socket?.destroy(), 10));
        return;
      }
      if (step.trickle) {
        // One byte every `trickle` ms.
        res.writeHead(step.status, { ...(step.headers ?? {}), 'content-length': String(body.length) });
        let i = 0;
        const timer = setInterval(() => {
          if (res.destroyed || i >= body.length) {
            clearInterval(timer);
            if (!res.destroyed) res.end();
            return;
          }
          res.write(body[i++]);
        }, step.trickle);
        res.on('close', () => clearInterval(timer));
        return;
      }
      res.writeHead(step.status, step.headers ?? {});
      res.end(body);
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

/** A TCP port free on 127.0.0.1 now (for a server a test starts in another process). */
export function freePort() {
  return new Promise((resolve, reject) => {
    const s = createNetServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}
