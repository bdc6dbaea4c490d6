// POST /v1/route_feedback and the ledger behind it (route_feedback.h).
#include "route_feedback.h"

#include <nlohmann/json.hpp>

#include "json_body.h"
#include "openai_service.h"

namespace tessera::server {

using json = nlohmann::json;

void RouteLedger::record(const std::string& id, const std::string& router, const std::string& arm) {
  if (capacity_ == 0) return;
  auto [it, inserted] = entries_.try_emplace(id, Entry{router, arm, {}});
  if (!inserted) return;  // ids are random; a repeat keeps the first answer's arm
  order_.push_back(id);
  while (order_.size() > capacity_) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
}

RouteLedger::Entry* RouteLedger::find(const std::string& id) {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : &it->second;
}

// {"id": "<a routed response's id>", "better_model": "<deployment>"}: the deployment that should
// have answered (the routed one when the route was right). Counted once per response in
// tessera_router_feedback_total{router, arm, verdict}; answers the verdict.
void OpenAiService::handle_route_feedback(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                                          const std::string& endpoint) {
  const auto bad_request = [&](const std::string& message, const std::string& param) {
    reply_error(channel, endpoint, http::status::bad_request, message, "invalid_request_error", param);
  };
  auto body = read_json_object(req, channel, endpoint);
  if (!body) return;
  for (const auto& [key, value] : body->items())
    if (key != "id" && key != "better_model")
      return bad_request("unknown field '" + key + "'; expected 'id' and 'better_model'", key);
  auto id = body->find("id");
  if (id == body->end() || !id->is_string() || id->get_ref<const std::string&>().empty())
    return bad_request("id: expected the id of a routed response (a string, e.g. chatcmpl-...), got " +
                           (id == body->end() ? std::string("nothing") : describe_json(*id)),
                       "id");
  auto better = body->find("better_model");
  if (better == body->end() || !better->is_string())
    return bad_request("better_model: expected the name of the deployment that should have answered, got " +
                           (better == body->end() ? std::string("nothing") : describe_json(*better)),
                       "better_model");
  const std::string& better_name = better->get_ref<const std::string&>();
  if (!gateway_.find(better_name))
    return bad_request("better_model: '" + better_name + "' is not a deployment; expected one of " + served_ids(),
                       "better_model");
  RouteLedger::Entry* entry = route_ledger_.find(id->get_ref<const std::string&>());
  if (!entry)
    return reply_error(channel, endpoint, http::status::not_found,
                       "id: no routed response '" + id->get_ref<const std::string&>() + "' among the last " +
                           std::to_string(route_ledger_.capacity()) +
                           " (only requests to a router are recorded, and only while the server runs)",
                       "invalid_request_error", "id", "unknown_response");
  if (!entry->feedback.empty())
    return reply_error(channel, endpoint, http::status::conflict,
                       "id: feedback for '" + id->get_ref<const std::string&>() + "' was already recorded (" +
                           entry->feedback + ")",
                       "invalid_request_error", "id", "duplicate_feedback");
  entry->feedback = better_name;
  const bool misroute = better_name != entry->arm;
  metrics_.count_route_feedback(entry->router, entry->arm, misroute);
  json out = {{"id", *id},
              {"object", "route_feedback"},
              {"router", entry->router},
              {"routed_to", entry->arm},
              {"better_model", better_name},
              {"misroute", misroute}};
  reply(channel, endpoint, make_json_response(http::status::ok, out.dump(-1, ' ', false, json::error_handler_t::replace)));
}

}  // namespace tessera::server
